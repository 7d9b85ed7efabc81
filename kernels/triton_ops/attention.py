"""Unified paged attention in Triton: one launch for a mixed batch of prefill chunks and decodes.

Called by ``TritonBackend.paged_attention`` (``kernels/triton_ops/backend.py``) after the step's new
K/V have been written to the cache, so every key a query needs is in the paged cache and
prefill chunks, prefix-cached prompts and decode tokens are one case: query ``j`` of a request
with ``q_len`` new tokens and ``seq_len`` cached tokens sits at position ``seq_len - q_len + j``
and attends to the keys at positions ``0 ..`` that position.

The kernel is FlashAttention-2's forward pass (Dao 2023, "FlashAttention-2", Algorithm 1: an
online softmax over key tiles, rescaling the running sum and output as the row maximum grows),
with the key tiles gathered through the request's block table. One program owns ``BLOCK_Q``
query tokens of one request and the ``NUM_GROUP`` query heads that share one KV head (GQA):
their ``BLOCK_Q * NUM_GROUP`` rows form one query tile, so each K/V tile is read once for the
whole group instead of once per query head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from corefleet.kernels.backend import FP8_KV_DTYPES
from corefleet.kernels.triton_ops.support import (
    check_launchable,
    interpreter_tile,
    is_interpreted,
)

# GPU tiles. A decode-only batch runs one token per program (BLOCK_Q = 1), so a program reads
# its request's keys once for the head group; batches with prefill chunks pack up to 64 rows.
_GPU_TILE_N = 64  # keys per loop iteration: 64 x 128 x 2 bytes = 16 KiB of K per tile
_GPU_ROWS = 64
# Under the interpreter every program runs one after another and every tl.* call is a numpy
# call: fewer, bigger tiles are what make the CPU tests and engine runs affordable.
_INTERPRETER_TILE_N = 256
_INTERPRETER_ROWS = 256
_MIN_DOT_ROWS = 16  # tl.dot needs M >= 16 on GPUs


def unified_attention(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [R, max_blocks] int32
    seq_lens: torch.Tensor,  # [R] int32: tokens in the cache after this step (cached + new)
    query_start_loc: torch.Tensor,  # [R + 1] int32: request r owns query rows [qsl[r], qsl[r+1])
    max_query_len: int,
    max_seq_len: int,
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    """Causal attention of every query token over its request's cached and new tokens.

    Same contract as ``reference.paged_attention`` (which reads the precomputed slots instead
    of block tables). Requests are in any order and may have any number of new tokens (at least
    one); each request's ``seq_len`` tokens must already be in the cache. ``max_query_len`` and
    ``max_seq_len`` are the longest of each (host integers: they size the grid and tiles).

    Raises:
        ValueError: mismatched shapes, dtypes or devices, or non-contiguous caches.
    """
    _check_inputs(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    num_tokens, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    num_reqs = seq_lens.shape[0]
    if cache_head_dim != head_dim or num_q_heads % num_kv_heads:
        raise ValueError(
            f"query [T, {num_q_heads}, {head_dim}] does not fit the cache "
            f"[.., {num_kv_heads}, {cache_head_dim}]"
        )
    out = torch.empty_like(query)  # [T, Hq, D]
    if num_tokens == 0 or num_reqs == 0:
        return out
    group = num_q_heads // num_kv_heads
    interpreted = is_interpreted(_unified_attention_kernel)
    rows = _INTERPRETER_ROWS if interpreted else _GPU_ROWS
    # No wider query tile than the longest request needs (a decode-only step: one token per
    # program), since every padding row costs as much as a real one.
    block_q = max(1, min(rows // group, max_query_len))
    block_m = max(_MIN_DOT_ROWS, triton.next_power_of_2(block_q * group))
    tile_n = _GPU_TILE_N
    if interpreted:  # one key tile for short contexts: the loop's cost is per iteration there
        tile_n = max(_MIN_DOT_ROWS, interpreter_tile(max_seq_len, _INTERPRETER_TILE_N))
    grid = (num_reqs, triton.cdiv(max(max_query_len, 1), block_q), num_kv_heads)
    _unified_attention_kernel[grid](
        out,
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        NUM_GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        TILE_N=tile_n,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        # The interpreter's tl.dot multiplies bfloat16 operands' raw bits (it stores them as
        # uint16): there the operands are upcast first, the same values with the same float32
        # accumulation.
        DOT_IN_F32=interpreted and query.dtype == torch.bfloat16,
        KV_FP8=k_cache.dtype in FP8_KV_DTYPES,
    )
    return out


def _check_inputs(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> None:
    check_launchable(
        _unified_attention_kernel, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc
    )
    if query.dim() != 3 or query.stride(2) != 1:
        raise ValueError("query must be [T, Hq, D] with a contiguous last dimension")
    if k_cache.dim() != 4 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous [num_blocks, bs, Hkv, D]")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} != v_cache {tuple(v_cache.shape)}")
    fp8_cache = k_cache.dtype in FP8_KV_DTYPES and v_cache.dtype == k_cache.dtype
    if not (fp8_cache or query.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(
            f"dtypes differ: query {query.dtype}, k {k_cache.dtype}, v {v_cache.dtype}"
        )
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
    if query_start_loc.dtype != torch.int32 or query_start_loc.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError("query_start_loc must be int32 [R + 1]")
    if block_tables.dim() != 2 or block_tables.stride(1) != 1:
        raise ValueError("block_tables must be [R, max_blocks] with contiguous rows")


@triton.jit
def _unified_attention_kernel(
    out_ptr: tl.tensor,  # [T, Hq, D]
    q_ptr: tl.tensor,  # [T, Hq, D]
    k_cache_ptr: tl.tensor,  # [num_blocks, BLOCK_SIZE, Hkv, D]
    v_cache_ptr: tl.tensor,  # [num_blocks, BLOCK_SIZE, Hkv, D], strides equal to k_cache's
    block_tables_ptr: tl.tensor,  # [R, max_blocks] int32
    seq_lens_ptr: tl.tensor,  # [R] int32
    query_start_loc_ptr: tl.tensor,  # [R + 1] int32
    scale: float,  # softmax scale, usually D ** -0.5
    stride_q_tok: int,
    stride_q_head: int,
    stride_o_tok: int,
    stride_o_head: int,
    stride_cache_block: int,
    stride_cache_slot: int,
    stride_cache_head: int,
    stride_table_req: int,
    NUM_GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # HEAD_DIM rounded up to a power of two (tl.arange needs one)
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # query rows per program: BLOCK_Q * NUM_GROUP, padded to 2^k >= 16
    TILE_N: tl.constexpr,  # keys per loop iteration (independent of BLOCK_SIZE)
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 inputs: no TF32 rounding of Q and K
    DOT_IN_F32: tl.constexpr,  # upcast dot operands (the interpreter's bfloat16 workaround)
    KV_FP8: tl.constexpr,  # the cache holds float8: K and V are widened to q's dtype on load
) -> None:
    req = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return  # the grid is sized for the longest request; shorter ones end early
    seq_len = tl.load(seq_lens_ptr + req)
    num_cached = seq_len - q_len  # tokens cached before this step's new ones

    # Row m of the tile is query token (q_tile * BLOCK_Q + m // NUM_GROUP), query head
    # (kv_head * NUM_GROUP + m % NUM_GROUP): the group's heads of one token are adjacent rows.
    offs_m = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    token = q_tile * BLOCK_Q + offs_m // NUM_GROUP  # [BLOCK_M] token index within the request
    head = kv_head * NUM_GROUP + offs_m % NUM_GROUP  # [BLOCK_M]
    row_valid = (offs_m < BLOCK_Q * NUM_GROUP) & (token < q_len)  # padding rows: no I/O
    offs_d = tl.arange(0, HEAD_DIM_PAD)  # [D_PAD]
    dim_valid = offs_d < HEAD_DIM

    q_rows = (q_start + token).to(tl.int64) * stride_q_tok + head * stride_q_head  # [BLOCK_M]
    q = tl.load(
        q_ptr + q_rows[:, None] + offs_d[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )  # [BLOCK_M, D_PAD]
    q_pos = num_cached + token  # [BLOCK_M] absolute position of each row's token

    # Keys this tile may see: up to its last real token's position. Key 0 is visible to every
    # row, so after the first tile every row max is finite and exp() never sees -inf - -inf.
    last_token = tl.minimum(q_len, (q_tile + 1) * BLOCK_Q) - 1
    num_keys = num_cached + last_token + 1

    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # [BLOCK_M]
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)  # [BLOCK_M]
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)  # [BLOCK_M, D_PAD]
    table_row = block_tables_ptr + req.to(tl.int64) * stride_table_req

    for key_start in range(0, num_keys, TILE_N):
        k_pos = key_start + tl.arange(0, TILE_N)  # [TILE_N]
        key_valid = k_pos < num_keys
        # Each key's block through the table; slots past num_keys are never read, so stale
        # or NaN cache contents outside the request cannot leak in.
        block = tl.load(table_row + k_pos // BLOCK_SIZE, mask=key_valid, other=0)  # [TILE_N]
        slot = (
            block.to(tl.int64) * stride_cache_block
            + (k_pos % BLOCK_SIZE) * stride_cache_slot
            + kv_head * stride_cache_head
        )  # [TILE_N] element offset of each key's head vector
        kv_mask = dim_valid[:, None] & key_valid[None, :]  # [D_PAD, TILE_N]
        k = tl.load(k_cache_ptr + slot[None, :] + offs_d[:, None], mask=kv_mask, other=0.0)
        # k: [D_PAD, TILE_N], already transposed for Q @ K^T
        if KV_FP8:  # a float8 cache is storage only: its values are exact in q's dtype
            k = k.to(tl.float32).to(q.dtype)

        # (No jit helper for the two dots: the interpreter re-patches triton.language on every
        # nested jit call, which costs more than the rest of the loop body.)
        if DOT_IN_F32:
            scores = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
        else:
            scores = tl.dot(q, k, input_precision=DOT_PRECISION)
        scores = scores * scale  # [BLOCK_M, TILE_N] float32
        visible = (k_pos[None, :] <= q_pos[:, None]) & key_valid[None, :]  # causal mask
        scores = tl.where(visible, scores, float("-inf"))

        new_max = tl.maximum(row_max, tl.max(scores, axis=1))  # [BLOCK_M]
        rescale = tl.exp(row_max - new_max)  # [BLOCK_M]: 0 on the first tile (exp(-inf))
        probs = tl.exp(scores - new_max[:, None])  # [BLOCK_M, TILE_N]
        row_sum = row_sum * rescale + tl.sum(probs, axis=1)
        v = tl.load(
            v_cache_ptr + slot[:, None] + offs_d[None, :],
            mask=key_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )  # [TILE_N, D_PAD]
        if KV_FP8:
            v = v.to(tl.float32).to(q.dtype)
        # P in the cache's dtype for the second matmul, as FlashAttention does; for float32
        # caches this is exact.
        p = probs.to(v.dtype)
        if DOT_IN_F32:
            pv = tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p, v, input_precision=DOT_PRECISION)
        acc = acc * rescale[:, None] + pv  # [BLOCK_M, D_PAD]
        row_max = new_max

    acc = acc / row_sum[:, None]
    o_rows = (q_start + token).to(tl.int64) * stride_o_tok + head * stride_o_head  # [BLOCK_M]
    tl.store(
        out_ptr + o_rows[:, None] + offs_d[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & dim_valid[None, :],
    )
