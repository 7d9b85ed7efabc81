"""The ``cpu`` kernel backend: C++ ops for attention, the layer ops, linears (float and GGUF
blocks), mixture-of-experts layers and argmax.

``CpuBackend`` overrides the ``KernelBackend`` methods it accelerates and hands every input its
ops do not take (another dtype, a head size the AVX-512 path cannot tile, non-contiguous
tensors) back to the torch implementations. The ops live in ``csrc/``, are built with the package
(one library per instruction-set variant) and loaded by ``loader.load_cpu_ops``; why each one
beats torch, with the measurements, is in ``docs/kernels.md``.

Attention reads K/V in place from the paged cache: the C++ op walks each row's block table and
reads only the positions below the row's context length, where the torch path gathers every
row's blocks into a padded copy. A row is one new token (a decode token, or one token of a
prefill chunk with its own length), so one call attends a whole step.

GGUF-quantized weights stay in their blocks (``kernels/gguf_quant.py``). With
``COREFLEET_GGUF_PACKED=1``, Q4_0, Q4_1 and Q8_0 weights are repacked in place once their layer
is loaded (``packed_gguf.py``, where the build has AVX512-VNNI) and every batch size multiplies
them with ``gguf_linear_vnni``: activations quantized per block to int8, integer dot products.
Otherwise (the default, and the other formats): a decode step's few rows multiply them with
``gguf_linear``, which dequantizes in registers as it streams the blocks (reading 0.56-1.06
bytes a weight instead of 2 or 4); a prefill's many rows dequantize the weight to x's dtype
once (``gguf_dequantize``) and run torch's GEMM.

A mixture-of-experts layer's experts are one ``fused_moe`` call (``csrc/fused_moe_cpu.cpp``):
the routed rows grouped by expert once, the experts of a decode step streamed together through
register tiles, large prefill groups on torch's GEMM, the weighted sum in float32.
"""

from __future__ import annotations

import dataclasses

import torch

from corefleet.kernels import gguf_quant
from corefleet.kernels.backend import KernelBackend, Linear, Norm
from corefleet.kernels.cpu import packed_gguf
from corefleet.kernels.cpu.loader import load_cpu_ops
from corefleet.kernels.gguf_quant import QuantFormat
from corefleet.kernels.metadata import AttentionMetadata


def paged_attention(
    query: torch.Tensor,  # [B, Hq, D] float32 or bfloat16, last dim contiguous
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] contiguous, query's dtype
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] contiguous, query's dtype
    block_table: torch.Tensor,  # [B, max_blocks] int64
    context_lens: torch.Tensor,  # [B] int64, each in [1, max_blocks * block_size]
    scale: float,
) -> torch.Tensor:  # [B, Hq, D]
    """``torch.ops.corefleet_cpu.paged_attention``: row ``b``'s one query token attends to the
    first ``context_lens[b]`` positions of its blocks (a prefill chunk is one row per token).

    Raises what loading the ops raises (``loader.CpuOpsUnavailable``: no build fits), and
    RuntimeError for arguments the op does not take.
    """
    out: torch.Tensor = load_cpu_ops().paged_attention(
        query, k_cache, v_cache, block_table, context_lens, scale
    )
    return out


# Row counts up to which the C++ small-batch linear beats torch's GEMM on weights streamed
# from memory, as in a decode step (docs/kernels.md has the measurements).
_SMALL_LINEAR_MAX_ROWS = {torch.float32: 64, torch.bfloat16: 64}
_FUSED_DTYPES = (torch.float32, torch.bfloat16)  # what the C++ ops are built for
# Row counts up to which gguf_linear beats dequantizing the weight to x's dtype for torch's
# GEMM (docs/kernels.md has the measurements): in float32 the op's own multiply loop outruns
# MKL's GEMM at every measured size (1.4-1.9x at 512-1024 rows), so only very large prefill
# chunks take the GEMM; in bfloat16 oneDNN's GEMM overtakes it from 32-64 rows.
GGUF_LINEAR_MAX_ROWS = {torch.float32: 1024, torch.bfloat16: 32}
# The GGUF formats the C++ ops decode (csrc/gguf_blocks.h), by ggml type id: Q4_0, Q4_1, Q8_0,
# Q4_K, Q5_K, Q6_K.
_GGUF_OP_TYPES = frozenset({2, 3, 8, 12, 13, 14})
# Rows of one expert from which fused_moe runs its projections on torch's GEMM (oneDNN/MKL)
# rather than streaming the expert's weights through its own tiles: measured equal at 256 rows
# in both dtypes, the tiles 1.1-1.2x faster at 128 and 1.9-2.2x at 16 (benchmarks/README.md,
# "Fused MoE"). 256 is also the most the op streams.
FUSED_MOE_GEMM_MIN_ROWS = {torch.float32: 256, torch.bfloat16: 256}
_ROUTING_ID_DTYPES = (torch.int32, torch.int64)


def _gguf_op_takes(qweight: torch.Tensor, fmt: QuantFormat, dtype: torch.dtype) -> bool:
    """Whether the GGUF ops take this weight (its format and layout) and activation dtype."""
    return (
        dtype in _FUSED_DTYPES
        and fmt.ggml_type in _GGUF_OP_TYPES
        and qweight.dtype == torch.uint8
        and qweight.dim() == 2
    )


class CpuBackend(KernelBackend):
    """The C++ CPU kernels: attention in place on the paged cache (every new token of a step,
    decodes and prefill chunks alike), the fused layer ops, the KV-cache write, argmax, the
    experts of a mixture-of-experts layer, and a small-batch linear for steps of a few tokens;
    large batches' matmuls stay on torch (oneDNN)."""

    name = "cpu"

    def __init__(self) -> None:
        # Load now, so a missing or unloadable build surfaces at start-up (where the selector
        # can fall back) rather than in the first forward pass.
        self._ops = load_cpu_ops()
        self._pack_gguf = packed_gguf.enabled(self._ops)

    def linear(
        self,
        x: torch.Tensor,  # [T, K]
        weight: torch.Tensor,  # [N, K]
        bias: torch.Tensor | None,  # [N]
    ) -> torch.Tensor:  # [T, N]
        """A few rows stream the weights through the C++ op; more are a GEMM for torch."""
        max_rows = _SMALL_LINEAR_MAX_ROWS.get(x.dtype, 0)
        if (
            x.shape[0] <= max_rows
            and x.shape[1] % 16 == 0  # the op's AVX-512 path needs K % 16 == 0
            and x.is_contiguous()
            and weight.is_contiguous()
            and weight.dtype == x.dtype
        ):
            out: torch.Tensor = self._ops.small_linear(x, weight, bias)
            return out
        return super().linear(x, weight, bias)

    def quant_linear(
        self,
        x: torch.Tensor,  # [T, K]
        qweight: torch.Tensor,  # [N, K / block_elems * block_bytes] uint8, GGUF blocks
        fmt: QuantFormat,
        bias: torch.Tensor | None,  # [N], x's dtype
    ) -> torch.Tensor:  # [T, N], x's dtype
        """A packed weight: ``gguf_linear_vnni``. Otherwise a few rows stream the blocks
        through ``gguf_linear``; more dequantize the weight to x's dtype once for torch's GEMM
        (float16 and other formats: the reference)."""
        if packed_gguf.is_packed(qweight) and x.dim() == 2:
            return packed_gguf.packed_linear(self._ops, x, qweight, fmt, bias)
        if (
            not _gguf_op_takes(qweight, fmt, x.dtype)
            or x.dim() != 2
            or (bias is not None and bias.dtype != x.dtype)
        ):
            return super().quant_linear(x, qweight, fmt, bias)
        qweight = qweight.contiguous()  # a no-op for the loader's weights
        if x.shape[0] <= GGUF_LINEAR_MAX_ROWS[x.dtype]:
            b = None if bias is None else bias.contiguous()
            out: torch.Tensor = self._ops.gguf_linear(x.contiguous(), qweight, fmt.ggml_type, b)
            return out
        weight = self._ops.gguf_dequantize(qweight, fmt.ggml_type, x.shape[1], x.dtype)
        return torch.nn.functional.linear(x, weight, bias)

    def bind_linear(self, weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
        """``linear``'s choice, with the weight's part of it made once."""
        max_rows = _SMALL_LINEAR_MAX_ROWS.get(weight.dtype, 0)
        if not (max_rows and weight.shape[1] % 16 == 0 and weight.is_contiguous()):
            return super().bind_linear(weight, bias)
        small_linear, fallback = self._ops.small_linear, super().linear

        def linear(x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
            if x.shape[0] <= max_rows and x.dtype == weight.dtype and x.is_contiguous():
                out: torch.Tensor = small_linear(x, weight, bias)
                return out
            return fallback(x, weight, bias)

        return linear

    def bind_quant_linear(
        self, qweight: torch.Tensor, fmt: QuantFormat, bias: torch.Tensor | None, dtype: torch.dtype
    ) -> Linear:
        """``quant_linear``'s choice, with the weight's and the dtype's part of it made once."""
        if packed_gguf.is_packed(qweight):
            ops = self._ops
            return lambda x: packed_gguf.packed_linear(ops, x, qweight, fmt, bias)
        if not (
            _gguf_op_takes(qweight, fmt, dtype)
            and qweight.is_contiguous()
            and (bias is None or (bias.dtype == dtype and bias.is_contiguous()))
        ):
            return super().bind_quant_linear(qweight, fmt, bias, dtype)
        gguf_linear, fallback = self._ops.gguf_linear, self.quant_linear
        max_rows, ggml_type = GGUF_LINEAR_MAX_ROWS[dtype], fmt.ggml_type

        def linear(x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
            if x.shape[0] <= max_rows and x.dtype == dtype and x.is_contiguous():
                out: torch.Tensor = gguf_linear(x, qweight, ggml_type, bias)
                return out
            return fallback(x, qweight, fmt, bias)  # dequantize + GEMM, or the reference

        return linear

    def prepare_quant_weight(self, qweight: torch.Tensor, fmt: QuantFormat) -> None:
        """Q4_0/Q4_1/Q8_0 blocks repacked in place for ``gguf_linear_vnni`` (``packed_gguf``),
        where this build runs it on VNNI."""
        if self._pack_gguf:
            packed_gguf.pack_in_place(self._ops, qweight, fmt)

    def restore_quant_weight(self, qweight: torch.Tensor, fmt: QuantFormat) -> None:
        packed_gguf.unpack_in_place(self._ops, qweight)

    def bind_rms_norm(self, weight: torch.Tensor, eps: float) -> Norm:
        """``rms_norm`` on the C++ op, for a weight of a dtype it takes."""
        if weight.dtype not in _FUSED_DTYPES:
            return super().bind_rms_norm(weight, eps)
        op, fallback = self._ops.rms_norm, super().rms_norm

        def rms_norm(
            x: torch.Tensor, residual: torch.Tensor | None
        ) -> tuple[torch.Tensor, torch.Tensor]:  # normed, new residual: [T, H]
            if x.dtype != weight.dtype:
                return fallback(x, weight, eps, residual)
            normed, new_residual = op(x.contiguous(), residual, weight, eps)
            return normed, new_residual

        return rms_norm

    def quant_embedding(
        self,
        ids: torch.Tensor,  # [T] int64, each in [0, V)
        qweight: torch.Tensor,  # [V, K / block_elems * block_bytes] uint8, GGUF blocks
        fmt: QuantFormat,
        k: int,
        dtype: torch.dtype,
    ) -> torch.Tensor:  # [T, K] dtype
        """The selected rows' blocks, dequantized by ``gguf_dequantize`` (exactly the
        reference's values); a packed table's rows are unpacked first."""
        if packed_gguf.is_packed(qweight):
            rows = packed_gguf.file_rows(self._ops, qweight, ids)  # [T, row_bytes]
            if dtype not in _FUSED_DTYPES:
                return gguf_quant.dequantize(rows, fmt, k).to(dtype)
            packed_rows: torch.Tensor = self._ops.gguf_dequantize(rows, fmt.ggml_type, k, dtype)
            return packed_rows
        if not _gguf_op_takes(qweight, fmt, dtype):
            return super().quant_embedding(ids, qweight, fmt, k, dtype)
        rows = qweight.index_select(0, ids)  # [T, row_bytes], contiguous
        out: torch.Tensor = self._ops.gguf_dequantize(rows, fmt.ggml_type, k, dtype)
        return out

    def rms_norm(
        self,
        x: torch.Tensor,  # [T, H]
        weight: torch.Tensor,  # [H]
        eps: float,
        residual: torch.Tensor | None,  # [T, H]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # normed, new residual: [T, H]
        """Residual add and RMSNorm in one pass."""
        if x.dtype not in _FUSED_DTYPES or weight.dtype != x.dtype:
            return super().rms_norm(x, weight, eps, residual)
        normed, new_residual = self._ops.rms_norm(x.contiguous(), residual, weight, eps)
        return normed, new_residual

    def apply_rotary(
        self,
        query: torch.Tensor,  # [T, Hq, D], heads contiguous (a view into the fused qkv)
        key: torch.Tensor,  # [T, Hkv, D]
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,  # [T, 1, D]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotates query and key **in place** and returns them."""
        if query.dtype not in _FUSED_DTYPES:
            return super().apply_rotary(query, key, cos, sin)
        self._ops.rotary_(query, key, cos, sin)
        return query, key

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
        """silu(gate) * up in one pass over the fused gate/up projection."""
        if x.dtype not in _FUSED_DTYPES:
            return super().silu_and_mul(x)
        out: torch.Tensor = self._ops.silu_and_mul(x.contiguous())
        return out

    def fused_moe(
        self,
        x: torch.Tensor,  # [T, H]
        w13: torch.Tensor,  # [E, 2I, H] gate rows :I, up rows I:
        w2: torch.Tensor,  # [E, H, I]
        topk_weights: torch.Tensor,  # [T, K] float32
        topk_ids: torch.Tensor,  # [T, K] int32/int64; an id outside [0, E) is skipped
    ) -> torch.Tensor:  # [T, H], x's dtype
        """The experts in one C++ call: no per-expert Python, a decode step's experts read
        together at memory bandwidth (float16 and strided weights: the reference)."""
        if (
            x.dtype not in _FUSED_DTYPES
            or x.dim() != 2
            or w13.dtype != x.dtype
            or w2.dtype != x.dtype
            or not (w13.is_contiguous() and w2.is_contiguous())  # a copy would cost more
            or topk_ids.dtype not in _ROUTING_ID_DTYPES
        ):
            return super().fused_moe(x, w13, w2, topk_weights, topk_ids)
        out: torch.Tensor = self._ops.fused_moe(
            x.contiguous(),
            w13,
            w2,
            topk_weights.float().contiguous(),  # [T, K], a no-op for the router's output
            topk_ids.contiguous(),
            FUSED_MOE_GEMM_MIN_ROWS[x.dtype],
        )
        return out

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:  # [B, V] -> [B] int64
        """A vectorised two-pass argmax per row (torch's index-tracking reduction is not)."""
        if logits.dtype not in _FUSED_DTYPES or logits.shape[-1] == 0 or logits.dim() != 2:
            return super().argmax(logits)
        out: torch.Tensor = self._ops.argmax_rows(logits.contiguous())
        return out

    def write_kv_cache(
        self,
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        slot_mapping: torch.Tensor,  # [T] int64
    ) -> None:
        """One memcpy per token and tensor (torch's index_copy_ has a large fixed cost a call,
        paid twice per layer)."""
        if key.dtype != k_cache.dtype or key.stride(-1) != 1 or key.stride(-2) != key.shape[-1]:
            super().write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
            return
        self._ops.write_kv_cache_(key, value, k_cache, v_cache, slot_mapping)

    def rotary_to_cache(
        self,
        qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) * D]
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,  # [T, 1, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        slot_mapping: torch.Tensor,  # [T] int64
        num_heads: int,
        num_kv_heads: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q [T, Hq, D], k, v [T, Hkv, D]
        """One C++ call for the split, the rotation, the casts and the cache write (about ten
        torch ops a layer, ~1/15 of a single-stream decode step), with the same values."""
        if (
            qkv.dtype not in _FUSED_DTYPES
            or k_cache.dtype not in _FUSED_DTYPES
            or cos.dtype != qkv.dtype
            or qkv.dim() != 2
            or qkv.stride(1) != 1
            or not (cos.is_contiguous() and sin.is_contiguous())
        ):
            return super().rotary_to_cache(
                qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads
            )
        q, k, v = self._ops.rotary_to_cache(
            qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads
        )
        return q, k, v

    def paged_attention(
        self,
        query: torch.Tensor,  # [T, Hq, D]
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D]
        """The whole step in one C++ call, each new token a row over its request's cache up to
        its own position (the new K/V are written first). A prefill chunk so costs its exact
        causal triangle, where torch's fused SDPA does masked work on the diagonal's tiles."""
        if query.shape[2] % 16 != 0:  # the op's AVX-512 path needs D % 16 == 0
            return super().paged_attention(query, key, value, k_cache, v_cache, meta, scale)
        if meta.token_block_table is not None:
            assert meta.token_context_lens is not None
            return paged_attention(
                query, k_cache, v_cache, meta.token_block_table, meta.token_context_lens, scale
            )
        # Metadata built for the torch path alone (no token rows): the prefill spans on torch,
        # the decode rows here.
        no_decodes = dataclasses.replace(meta, num_decodes=0)
        out = super().paged_attention(query, key, value, k_cache, v_cache, no_decodes, scale)
        nd = meta.num_decodes
        if nd:
            assert meta.decode_block_table is not None and meta.decode_context_lens is not None
            out[:nd] = paged_attention(
                query[:nd],
                k_cache,
                v_cache,
                meta.decode_block_table,
                meta.decode_context_lens,
                scale,
            )
        return out
