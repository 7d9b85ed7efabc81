"""GGUF-quantized linear layers and embeddings in Triton: the weight stays in its blocks.

Called by ``TritonBackend.quant_linear`` and ``quant_embedding``. A weight ``[N, K]`` is the
GGUF file's bytes, ``uint8 [N, K / block_elems * block_bytes]`` (formats and bit layouts in
``kernels/gguf_quant.py``). Reading those bytes instead of a dequantized copy is the point: a
decode step is bound by weight bytes, and Q4_K reads 4.5 bits a value where bfloat16 reads 16.

Every format splits into *groups* of 32 consecutive values of a row that share their scale
(Q8_0/Q4_0/Q4_1: a whole block; Q4_K/Q5_K: a sub-block; Q6_K: two int8 scales), so one
helper, ``_dequant_groups``, turns a tile of ``[rows, groups]`` into ``[rows, groups, 32]``
float32 values: the per-group scalars (float16 scales read from their two bytes, 6-bit packed
K-quant scales) are loaded once per group and broadcast, the quantized integers one per value
at the byte and shift the format puts them. The matmul and the dequantize kernel both call it.
The format is a constexpr (its ggml type id), so each format compiles to its own kernel with
only its branch.

Dequantized values equal the reference exactly: every product of a float16 scale, a 6/8-bit
scale and a quant fits float32's 24-bit mantissa, and the one addition (Q4_1's and the
K-quants' min) rounds once, as in ``gguf_quant.dequantize``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from corefleet.kernels import gguf_quant
from corefleet.kernels.gguf_quant import QuantFormat
from corefleet.kernels.triton_ops.support import (
    check_launchable,
    interpreter_tile,
    is_interpreted,
)

GROUP = 32  # values per group, the unit of every format's scales
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SUPPORTED = frozenset(f.name for f in gguf_quant.FORMATS.values())

# Format ids inside the kernels (globals a @triton.jit function reads must be constexpr).
_Q4_0 = tl.constexpr(gguf_quant.Q4_0.ggml_type)
_Q4_1 = tl.constexpr(gguf_quant.Q4_1.ggml_type)
_Q8_0 = tl.constexpr(gguf_quant.Q8_0.ggml_type)
_Q4_K = tl.constexpr(gguf_quant.Q4_K.ggml_type)
_Q5_K = tl.constexpr(gguf_quant.Q5_K.ggml_type)
_Q6_K = tl.constexpr(gguf_quant.Q6_K.ggml_type)

# Under the interpreter every program runs in numpy one after another and every tl.* call has
# a fixed cost: few, large tiles (still more than one, so that tests cross tile edges).
_INTERPRETER_M, _INTERPRETER_N, _INTERPRETER_K = 32, 64, 128
_MIN_DOT = 16  # tl.dot needs every dimension >= 16 on GPUs


def gguf_linear(
    x: torch.Tensor,  # [M, K] float32 / bfloat16 / float16
    qweight: torch.Tensor,  # [N, K / block_elems * block_bytes] uint8
    fmt: QuantFormat,
    bias: torch.Tensor | None = None,  # [N], x's dtype
) -> torch.Tensor:  # [M, N], x's dtype
    """``x @ W.T + bias`` with ``W`` dequantized tile by tile in registers (float32 accumulation).

    Raises:
        ValueError: an unsupported format or dtype, mismatched shapes, or a device Triton
            cannot launch on.
    """
    tensors = (x, qweight) if bias is None else (x, qweight, bias)
    check_launchable(_gguf_matmul_kernel, *tensors)
    if x.dim() != 2 or x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x must be 2-D float32/bfloat16/float16, got {x.dtype} {x.shape}")
    m, k = x.shape
    n = _check_qweight(qweight, fmt, k)
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be [{n}] {x.dtype}, got {bias.dtype} {tuple(bias.shape)}")
    x = x if x.stride(1) == 1 else x.contiguous()
    qweight = qweight.contiguous()  # rows follow each other: row r starts at r * row_bytes
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)  # [M, N]
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    interpreted = is_interpreted(_gguf_matmul_kernel)
    if interpreted:
        block_m = interpreter_tile(m, _INTERPRETER_M)
        block_n = min(_INTERPRETER_N, triton.next_power_of_2(n))
        block_k, warps, stages = _INTERPRETER_K, 4, 1
    else:
        block_m, block_n, block_k, warps, stages = _gpu_tiles(m)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _gguf_matmul_kernel[grid](
        x,
        qweight,
        out if bias is None else bias,  # not read without a bias
        out,
        m,
        n,
        k,
        fmt.row_bytes(k),
        x.stride(0),
        out.stride(0),
        FMT=fmt.ggml_type,
        BLOCK_BYTES=fmt.block_bytes,
        GROUPS_PER_BLOCK=fmt.block_elems // GROUP,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        # The interpreter's tl.dot multiplies bfloat16 operands' raw bits (numpy has no
        # bfloat16): there both operands are upcast, the same values, the same accumulation.
        DOT_IN_F32=interpreted and x.dtype == torch.bfloat16,
        num_warps=warps,
        num_stages=stages,
    )
    return out


def gguf_dequantize(
    qweight: torch.Tensor,  # [V, K / block_elems * block_bytes] uint8
    fmt: QuantFormat,
    k: int,
    dtype: torch.dtype,
    ids: torch.Tensor | None = None,  # [T] int64, each in [0, V) (not checked: no host sync)
) -> torch.Tensor:  # [T, K] dtype (T = V without ids)
    """Rows ``ids`` (every row without ids) dequantized to ``dtype``: embedding lookups.

    Raises:
        ValueError: an unsupported format or dtype, mismatched shapes, or a device Triton
            cannot launch on.
    """
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dequantizes to float32/bfloat16/float16, not {dtype}")
    num_table_rows = _check_qweight(qweight, fmt, k)
    if ids is None:
        ids = torch.arange(num_table_rows, device=qweight.device)
    if ids.dim() != 1 or ids.dtype != torch.int64:
        raise ValueError(f"ids must be 1-D int64, got {ids.dtype} {tuple(ids.shape)}")
    check_launchable(_gguf_dequantize_kernel, qweight, ids)
    qweight = qweight.contiguous()
    out = torch.empty((ids.shape[0], k), dtype=dtype, device=qweight.device)  # [T, K]
    num_groups = k // GROUP
    if out.numel() == 0:
        return out
    if is_interpreted(_gguf_dequantize_kernel):
        block_r = interpreter_tile(ids.shape[0], 64)
        block_g = min(128, triton.next_power_of_2(num_groups))
    else:  # one row, 1024 values per program: 8 per thread at 4 warps
        block_r, block_g = 1, min(32, triton.next_power_of_2(num_groups))
    grid = (triton.cdiv(ids.shape[0], block_r), triton.cdiv(num_groups, block_g))
    _gguf_dequantize_kernel[grid](
        qweight,
        ids,
        out,
        ids.shape[0],
        num_groups,
        fmt.row_bytes(k),
        out.stride(0),
        FMT=fmt.ggml_type,
        BLOCK_BYTES=fmt.block_bytes,
        GROUPS_PER_BLOCK=fmt.block_elems // GROUP,
        BLOCK_R=block_r,
        BLOCK_G=block_g,
    )
    return out


def _check_qweight(qweight: torch.Tensor, fmt: QuantFormat, k: int) -> int:
    """The weight's row count, after checking it holds rows of ``k`` values of ``fmt``."""
    if fmt.name not in SUPPORTED:
        raise ValueError(f"no Triton kernel for GGUF format {fmt.name}")
    if qweight.dtype != torch.uint8 or qweight.dim() != 2:
        raise ValueError(f"a {fmt.name} weight is a 2-D uint8 tensor, got {qweight.dtype}")
    if k % fmt.block_elems or qweight.shape[1] != fmt.row_bytes(k):
        raise ValueError(
            f"a {fmt.name} row of {k} values has {fmt.row_bytes(k)} bytes "
            f"(k a multiple of {fmt.block_elems}), got {qweight.shape[1]}"
        )
    return int(qweight.shape[0])


def _gpu_tiles(m: int) -> tuple[int, int, int, int, int]:
    """BLOCK_M, BLOCK_N, BLOCK_K, warps and pipeline stages for ``m`` rows of x.

    Decode (m <= 16) is bound by the weight's bytes: narrow N tiles give enough programs to
    fill every SM (4096 outputs -> 256 programs) and a long K tile keeps bytes in flight.
    Prefill is bound by the dot: large square tiles dequantize each weight tile once for
    128 rows of x.
    """
    if m <= _MIN_DOT:
        return _MIN_DOT, 16, 256, 4, 4
    if m <= 64:
        return 64, 64, 128, 4, 3
    return 128, 128, 64, 8, 3


@triton.jit
def _load_f16(ptr: tl.tensor) -> tl.tensor:
    """A float16 field at byte pointers ``ptr`` (little-endian, as GGUF stores it), as float32.

    Read as two bytes rather than through a float16 pointer: the field's address is only
    guaranteed 2-byte aligned when the tensor's storage offset is even.
    """
    lo = tl.load(ptr).to(tl.uint16)
    hi = tl.load(ptr + 1).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _nibbles_16(w_ptr: tl.tensor, start: tl.tensor, lane: tl.tensor) -> tl.tensor:
    """Q4_0/Q4_1's 32 values from the 16 bytes at ``start`` ([R, G]): value j in byte j's low
    nibble, value j + 16 in its high one. -> [R, G, 32] float32 in 0..15."""
    byte = tl.load(w_ptr + start[:, :, None] + lane % 16)
    return ((byte >> (4 * (lane // 16))) & 15).to(tl.float32)


@triton.jit
def _k_nibbles(w_ptr: tl.tensor, start: tl.tensor, sub: tl.tensor, lane: tl.tensor) -> tl.tensor:
    """Q4_K/Q5_K's low four bits of sub-block ``sub`` ([1, G]) from the nibbles at ``start``
    ([R, G]): sub-blocks 2i and 2i + 1 share 32 bytes, the low nibbles and the high ones.
    -> [R, G, 32] int32."""
    byte = tl.load(w_ptr + start[:, :, None] + (32 * (sub // 2))[:, :, None] + lane)
    return ((byte >> (4 * (sub % 2))[:, :, None]) & 15).to(tl.int32)


@triton.jit
def _k_affine(w_ptr: tl.tensor, block: tl.tensor, sub: tl.tensor, q: tl.tensor) -> tl.tensor:
    """Q4_K/Q5_K values ``d * scale * q - dmin * min`` of sub-block ``sub`` ([1, G]) of the
    blocks at ``block`` ([R, G]), for quants ``q`` [R, G, 32].

    The 6-bit scale and min of sub-blocks 0-3 are the low six bits of bytes 4+s and 8+s; those
    of sub-blocks 4-7 are the low and high nibble of byte 12+(s-4), with the top two bits of
    bytes 4+(s-4) and 8+(s-4) above them.
    """
    low = sub % 4
    scale_byte = tl.load(w_ptr + block + 4 + low).to(tl.int32)  # [R, G]
    min_byte = tl.load(w_ptr + block + 8 + low).to(tl.int32)
    high_byte = tl.load(w_ptr + block + 12 + low).to(tl.int32)
    upper = sub >= 4
    scale = tl.where(upper, (high_byte & 15) | ((scale_byte >> 6) << 4), scale_byte & 63)
    mn = tl.where(upper, (high_byte >> 4) | ((min_byte >> 6) << 4), min_byte & 63)
    d = _load_f16(w_ptr + block) * scale.to(tl.float32)  # [R, G]
    dm = _load_f16(w_ptr + block + 2) * mn.to(tl.float32)
    return d[:, :, None] * q.to(tl.float32) - dm[:, :, None]


@triton.jit
def _q6_k(w_ptr: tl.tensor, block: tl.tensor, sub: tl.tensor, lane: tl.tensor) -> tl.tensor:
    """Q6_K values of the 32-value group ``sub`` ([1, G], 0-7) of the blocks at ``block``.

    128 bytes ``ql``, 64 bytes ``qh``, 16 int8 scales, ``d`` at byte 208. Each half of 128
    values has 64 bytes of ``ql`` (its quarters 0 and 1 in the low nibbles of bytes 0-31 and
    32-63, quarters 2 and 3 in the high ones) and 32 bytes of ``qh`` (bits 2i..2i+1 for
    quarter i). -> [R, G, 32] float32.
    """
    half = (sub // 4)[:, :, None]  # [1, G, 1]
    quarter = (sub % 4)[:, :, None]
    block3 = block[:, :, None]  # [R, G, 1]
    ql = tl.load(w_ptr + block3 + 64 * half + 32 * (quarter % 2) + lane)
    qh = tl.load(w_ptr + block3 + 128 + 32 * half + lane)
    q = ((ql >> (4 * (quarter // 2))) & 15) | (((qh >> (2 * quarter)) & 3) << 4)
    # One int8 scale per 16 values: the group's two, picked per lane.
    first = tl.load(w_ptr + block + 192 + 2 * sub).to(tl.int8, bitcast=True)  # [R, G]
    second = tl.load(w_ptr + block + 193 + 2 * sub).to(tl.int8, bitcast=True)
    scale = tl.where(lane < 16, first[:, :, None], second[:, :, None]).to(tl.float32)
    d = _load_f16(w_ptr + block + 208)[:, :, None] * scale
    return d * (q.to(tl.float32) - 32.0)


@triton.jit
def _dequant_groups(
    w_ptr: tl.tensor,  # uint8 weight bytes
    rows: tl.tensor,  # [R] int64 weight rows, all in range
    groups: tl.tensor,  # [G] int32 group indices along K (values 32g .. 32g + 31), in range
    row_bytes: int,
    FMT: tl.constexpr,  # ggml type id
    BLOCK_BYTES: tl.constexpr,
    GROUPS_PER_BLOCK: tl.constexpr,  # 1 for the 32-value formats, 8 for the K-quants
) -> tl.tensor:  # [R, G, 32] float32
    # The byte offset of each group's block, and the group's place in it (a sub-block).
    block = rows[:, None] * row_bytes + (groups // GROUPS_PER_BLOCK * BLOCK_BYTES)[None, :]
    sub = (groups % GROUPS_PER_BLOCK)[None, :]  # [1, G]
    lane = tl.arange(0, 32)[None, None, :]  # [1, 1, 32] the value within the group
    if FMT == _Q8_0:  # d, then 32 int8 quants
        q = tl.load(w_ptr + block[:, :, None] + 2 + lane).to(tl.int8, bitcast=True)
        w = _load_f16(w_ptr + block)[:, :, None] * q.to(tl.float32)
    elif FMT == _Q4_0:  # d, 16 bytes of nibbles; value = d * (q - 8)
        w = _load_f16(w_ptr + block)[:, :, None] * (_nibbles_16(w_ptr, block + 2, lane) - 8.0)
    elif FMT == _Q4_1:  # d, m, 16 bytes of nibbles; value = d * q + m
        q = _nibbles_16(w_ptr, block + 4, lane)
        w = _load_f16(w_ptr + block)[:, :, None] * q + _load_f16(w_ptr + block + 2)[:, :, None]
    elif FMT == _Q4_K:  # d, dmin, 12 scale bytes, 128 bytes of nibbles
        w = _k_affine(w_ptr, block, sub, _k_nibbles(w_ptr, block + 16, sub, lane))
    elif FMT == _Q5_K:  # as Q4_K, with qh (bit s of qh[j]: value j's fifth bit) before the nibbles
        qh = tl.load(w_ptr + block[:, :, None] + 16 + lane).to(tl.int32)
        q = _k_nibbles(w_ptr, block + 48, sub, lane) | (((qh >> sub[:, :, None]) & 1) << 4)
        w = _k_affine(w_ptr, block, sub, q)
    else:  # _Q6_K
        w = _q6_k(w_ptr, block, sub, lane)
    return w


@triton.jit
def _gguf_matmul_kernel(
    x_ptr: tl.tensor,  # [M, K]
    w_ptr: tl.tensor,  # [N, row_bytes] uint8
    bias_ptr: tl.tensor,  # [N]; read only when HAS_BIAS
    out_ptr: tl.tensor,  # [M, N]
    m: int,
    n: int,
    k: int,
    row_bytes: int,
    stride_x: int,
    stride_out: int,
    FMT: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
    GROUPS_PER_BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # a multiple of 32; K need not be a multiple of it
    DOT_PRECISION: tl.constexpr,
    DOT_IN_F32: tl.constexpr,
) -> None:
    GROUPS: tl.constexpr = BLOCK_K // 32
    rows_m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # [BM]
    cols_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output columns
    # Weight rows and groups past the end are clamped to the last ones, not masked: every
    # weight load is then unconditional (a mask costs a select per value), the repeated rows
    # fill output columns that are never stored, and the repeated groups meet x's zeros.
    rows_n = tl.minimum(cols_n, n - 1).to(tl.int64)  # [BN] weight rows
    last_group = k // 32 - 1
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        groups = tl.minimum(k0 // 32 + tl.arange(0, GROUPS), last_group)  # [G]
        w = _dequant_groups(w_ptr, rows_n, groups, row_bytes, FMT, BLOCK_BYTES, GROUPS_PER_BLOCK)
        w = tl.reshape(w, (BLOCK_N, BLOCK_K))  # [BN, BK]: groups are consecutive along K
        cols = k0 + tl.arange(0, BLOCK_K)  # [BK]
        x_mask = (rows_m < m)[:, None] & (cols < k)[None, :]
        x = tl.load(x_ptr + rows_m[:, None] * stride_x + cols[None, :], mask=x_mask, other=0.0)
        if DOT_IN_F32:  # w rounded to x's dtype first, as the reference's weight.to(dtype)
            w_op = w.to(x_ptr.dtype.element_ty).to(tl.float32)
            x = x.to(tl.float32)
        else:
            w_op = w.to(x_ptr.dtype.element_ty)
        acc = tl.dot(x, tl.trans(w_op), acc, input_precision=DOT_PRECISION)  # [BM, BN]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols_n, mask=cols_n < n, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    out_mask = (rows_m < m)[:, None] & (cols_n < n)[None, :]
    out_offs = rows_m[:, None] * stride_out + cols_n[None, :]
    tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _gguf_dequantize_kernel(
    w_ptr: tl.tensor,  # [V, row_bytes] uint8
    ids_ptr: tl.tensor,  # [T] int64
    out_ptr: tl.tensor,  # [T, K]
    num_ids: int,
    num_groups: int,  # K / 32
    row_bytes: int,
    stride_out: int,
    FMT: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
    GROUPS_PER_BLOCK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_G: tl.constexpr,
) -> None:
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR] output rows
    groups = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)  # [BG]
    # Out-of-range output rows read table row 0 and groups the last group (loads stay
    # unconditional, as in the matmul); the store drops them.
    rows = tl.load(ids_ptr + r, mask=r < num_ids, other=0)  # [BR] int64 table rows
    w = _dequant_groups(
        w_ptr,
        rows,
        tl.minimum(groups, num_groups - 1),
        row_bytes,
        FMT,
        BLOCK_BYTES,
        GROUPS_PER_BLOCK,
    )  # [BR, BG, 32]
    mask = (r < num_ids)[:, None] & (groups < num_groups)[None, :]  # [BR, BG]
    cols = groups[:, None] * 32 + tl.arange(0, 32)[None, :]  # [BG, 32]
    offs = r.to(tl.int64)[:, None, None] * stride_out + cols[None, :, :]  # [BR, BG, 32]
    tl.store(out_ptr + offs, w.to(out_ptr.dtype.element_ty), mask=mask[:, :, None])
