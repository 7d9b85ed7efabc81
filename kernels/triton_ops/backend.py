"""The Triton backend: every layer op and paged attention as Triton kernels.

Chosen by ``select_kernel_backend`` (``--attention-backend triton``, or ``auto`` on CUDA
without flash-attn). Float linear layers and argmax stay on ``KernelBackend``'s torch (cuBLAS
already streams weights at bandwidth); GGUF-quantized linears and embeddings read their blocks
in Triton (``gguf_matmul.py``); everything between the linears is one Triton kernel each. A
mixture-of-experts layer's experts are grouped GEMMs over the tokens sorted by expert
(``fused_moe.py``). Attention takes the block-table metadata (``AttentionMetadata.block_tables``
and friends), so the model runner builds no per-request gathers for it. Importing this module
imports Triton.
"""

from __future__ import annotations

import torch

from corefleet.kernels.backend import KernelBackend
from corefleet.kernels.gguf_quant import QuantFormat
from corefleet.kernels.metadata import AttentionMetadata
from corefleet.kernels.triton_ops.activation import silu_and_mul
from corefleet.kernels.triton_ops.attention import unified_attention
from corefleet.kernels.triton_ops.fused_moe import FLOAT_DTYPES as MOE_DTYPES
from corefleet.kernels.triton_ops.fused_moe import ID_DTYPES, fused_moe
from corefleet.kernels.triton_ops.gguf_matmul import (
    FLOAT_DTYPES,
    SUPPORTED,
    gguf_dequantize,
    gguf_linear,
)
from corefleet.kernels.triton_ops.kv_cache import write_kv_cache
from corefleet.kernels.triton_ops.rms_norm import rms_norm
from corefleet.kernels.triton_ops.rotary import apply_rotary


class TritonBackend(KernelBackend):
    """Triton kernels for norm, rotary, SiLU-and-mul, the KV-cache write, paged attention,
    mixture-of-experts layers and GGUF-quantized linears and embeddings."""

    name = "triton"
    needs_block_tables = True

    def quant_linear(
        self,
        x: torch.Tensor,  # [T, K]
        qweight: torch.Tensor,  # [N, K / block_elems * block_bytes] uint8
        fmt: QuantFormat,
        bias: torch.Tensor | None,  # [N]
    ) -> torch.Tensor:  # [T, N]
        """Dequantizes the blocks tile by tile in registers (``triton_ops/gguf_matmul.py``);
        other dtypes, shapes or formats go to the torch reference."""
        fits = x.dim() == 2 and x.dtype in FLOAT_DTYPES and fmt.name in SUPPORTED
        if fits and (bias is None or bias.dtype == x.dtype):
            return gguf_linear(x, qweight, fmt, bias)
        return super().quant_linear(x, qweight, fmt, bias)

    def quant_embedding(
        self,
        ids: torch.Tensor,  # [T] int64
        qweight: torch.Tensor,  # [V, K / block_elems * block_bytes] uint8
        fmt: QuantFormat,
        k: int,
        dtype: torch.dtype,
    ) -> torch.Tensor:  # [T, K] dtype
        """The rows ``ids`` dequantized by one Triton launch (``triton_ops/gguf_matmul.py``)."""
        fits = ids.dim() == 1 and ids.dtype == torch.int64 and dtype in FLOAT_DTYPES
        if fits and fmt.name in SUPPORTED:
            return gguf_dequantize(qweight, fmt, k, dtype, ids)
        return super().quant_embedding(ids, qweight, fmt, k, dtype)

    def rms_norm(
        self,
        x: torch.Tensor,  # [T, H]
        weight: torch.Tensor,  # [H]
        eps: float,
        residual: torch.Tensor | None,  # [T, H]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # normed, new residual: [T, H]
        """Residual add and RMSNorm in one kernel (``triton_ops/rms_norm.py``)."""
        return rms_norm(x, weight, eps, residual)

    def apply_rotary(
        self,
        query: torch.Tensor,  # [T, Hq, D]
        key: torch.Tensor,  # [T, Hkv, D]
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,  # [T, 1, D]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotates query and key **in place** and returns them (``triton_ops/rotary.py``)."""
        return apply_rotary(query, key, cos, sin)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
        """One pass over the fused gate/up projection (``triton_ops/activation.py``)."""
        return silu_and_mul(x)

    def fused_moe(
        self,
        x: torch.Tensor,  # [T, H]
        w13: torch.Tensor,  # [E, 2I, H] gate rows :I, up rows I:
        w2: torch.Tensor,  # [E, H, I]
        topk_weights: torch.Tensor,  # [T, K] float32
        topk_ids: torch.Tensor,  # [T, K] int32/int64; an id outside [0, E) is skipped
    ) -> torch.Tensor:  # [T, H], x's dtype
        """One grouped GEMM per projection over the tokens sorted by expert
        (``triton_ops/fused_moe.py``); strided rows or other dtypes go to the reference."""
        fits = (
            x.dim() == 2
            and x.dtype in MOE_DTYPES
            and w13.dtype == x.dtype
            and w2.dtype == x.dtype
            and topk_ids.dtype in ID_DTYPES
            and x.stride(-1) == 1
            and w13.stride(-1) == 1
            and w2.stride(-1) == 1
        )
        if fits:
            return fused_moe(x, w13, w2, topk_weights.float().contiguous(), topk_ids)
        return super().fused_moe(x, w13, w2, topk_weights, topk_ids)

    def write_kv_cache(
        self,
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        slot_mapping: torch.Tensor,  # [T] int64
    ) -> None:
        """A row scatter, K and V together (``triton_ops/kv_cache.py``); slots < 0 are skipped."""
        write_kv_cache(key, value, k_cache, v_cache, slot_mapping)

    def paged_attention(
        self,
        query: torch.Tensor,  # [T, Hq, D]
        key: torch.Tensor,  # [T, Hkv, D] unused: the new tokens are read from the cache
        value: torch.Tensor,  # [T, Hkv, D] unused
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D]
        """Every new token over its request's cache, prefill and decode in one launch."""
        block_tables, seq_lens, query_start_loc = require_block_tables(meta)
        return unified_attention(
            query,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            meta.max_query_len,
            meta.max_seq_len,
            scale,
        )


def require_block_tables(
    meta: AttentionMetadata,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(block_tables, seq_lens, query_start_loc)``, or ValueError if the runner left them out."""
    if meta.block_tables is None or meta.seq_lens is None or meta.query_start_loc is None:
        raise ValueError(
            "this attention backend needs block_tables, seq_lens and query_start_loc in the "
            "attention metadata (the model runner fills them when needs_block_tables is True)"
        )
    return meta.block_tables, meta.seq_lens, meta.query_start_loc
