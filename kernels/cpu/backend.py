"""CPU paged attention: a C++ decode kernel that reads K/V in place from the paged cache.

The torch reference gathers every decode row's blocks into a padded copy and runs SDPA over
it, which moves several times the bytes the attention needs. The C++ op in
``csrc/paged_attention_cpu.cpp`` walks each row's block table instead and reads only the
positions below the row's context length. Prefill spans (several new tokens) stay on the
reference path.

The op is compiled at first use with the other C++ CPU ops (``cpu_ops.load_cpu_ops``).
"""

from __future__ import annotations

import dataclasses

import torch

from corefleet.kernels import reference
from corefleet.kernels.cpu.build import load_cpu_ops
from corefleet.kernels.metadata import AttentionMetadata


def load_cpu_attention_op() -> torch._ops.OpOverloadPacket:
    """Compile (or reuse) the C++ ops and return ``torch.ops.corefleet_cpu.paged_decode_attention``.

    Raises whatever the build raises (no ninja, no compiler, compile error); callers decide
    whether to fall back.
    """
    op: torch._ops.OpOverloadPacket = load_cpu_ops().paged_decode_attention
    return op


def decode_attention(
    query: torch.Tensor,  # [B, Hq, D] float32 or bfloat16, last dim contiguous
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] contiguous, query's dtype
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] contiguous, query's dtype
    block_table: torch.Tensor,  # [B, max_blocks] int64
    context_lens: torch.Tensor,  # [B] int64, each in [1, max_blocks * block_size]
    scale: float,
) -> torch.Tensor:  # [B, Hq, D]
    """Attention of one query token per row over its first ``context_lens[b]`` cached tokens."""
    op = load_cpu_attention_op()
    out: torch.Tensor = op(query, k_cache, v_cache, block_table, context_lens, scale)
    return out


# Row counts up to which the C++ small-batch linear beats torch's GEMM on weights streamed from
# memory (measured on the project's 2-core AVX-512 machine with every layer's weights cold, as
# in a decode step: float32 2.4x torch's rate at one row, 1.3-1.9x at 16-64 rows; bfloat16,
# with AVX512-BF16 dot products, 2.2x at one row, 1.5-1.6x at 32-64).
_SMALL_LINEAR_MAX_ROWS = {torch.float32: 64, torch.bfloat16: 64}
_FUSED_DTYPES = (torch.float32, torch.bfloat16)  # what the fused layer ops are built for


class CpuPagedAttentionBackend:
    """The C++ CPU kernels: attention in place on the paged cache (every new token of a step,
    decodes and prefill chunks alike), the fused layer ops, and a small-batch linear for steps
    of a few tokens; large batches' matmuls stay on torch (oneDNN)."""

    def __init__(self) -> None:
        # Compile now, so a broken toolchain surfaces at start-up (where the selector can
        # fall back) rather than in the first forward pass.
        self._ops = load_cpu_ops()

    @property
    def name(self) -> str:
        return "cpu"

    @property
    def needs_block_tables(self) -> bool:
        return False

    def linear(
        self,
        x: torch.Tensor,  # [T, K]
        weight: torch.Tensor,  # [N, K]
        bias: torch.Tensor | None,  # [N]
    ) -> torch.Tensor:  # [T, N]
        """``x @ weight.T + bias``; a few rows stream the weights through the C++ op."""
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
        return torch.nn.functional.linear(x, weight, bias)

    def rms_norm(
        self,
        x: torch.Tensor,  # [T, H]
        weight: torch.Tensor,  # [H]
        eps: float,
        residual: torch.Tensor | None,  # [T, H]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # normed, new residual: [T, H]
        """Residual add and RMSNorm in one pass (``reference.rms_norm``'s contract)."""
        if x.dtype not in _FUSED_DTYPES or weight.dtype != x.dtype:
            return reference.rms_norm(x, weight, eps, residual)
        normed, new_residual = self._ops.rms_norm(x.contiguous(), residual, weight, eps)
        return normed, new_residual

    def apply_rotary(
        self,
        query: torch.Tensor,  # [T, Hq, D], heads contiguous (a view into the fused qkv)
        key: torch.Tensor,  # [T, Hkv, D]
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,  # [T, 1, D]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotates query and key **in place** (they are fresh projections) and returns them."""
        if query.dtype not in _FUSED_DTYPES:
            return reference.apply_rotary(query, key, cos, sin)
        self._ops.rotary_(query, key, cos, sin)
        return query, key

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
        """silu(gate) * up in one pass over the fused gate/up projection."""
        if x.dtype not in _FUSED_DTYPES:
            return reference.silu_and_mul(x)
        out: torch.Tensor = self._ops.silu_and_mul(x.contiguous())
        return out

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:  # [B, V] -> [B] int64
        """torch.argmax(dim=-1) in C++: torch's takes ~1.3 ms for [64, 49152] float32 here,
        its index-tracking reduction unvectorised; the op needs ~0.1 ms."""
        if logits.dtype not in _FUSED_DTYPES or logits.shape[-1] == 0 or logits.dim() != 2:
            return logits.argmax(dim=-1)
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
        """Store the new tokens' K/V at their slots: one memcpy per token and tensor in C++
        (torch's index_copy_ costs ~14 us a call for one decode token, twice per layer)."""
        if key.dtype != k_cache.dtype or key.stride(-1) != 1 or key.stride(-2) != key.shape[-1]:
            reference.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
            return
        self._ops.write_kv_cache_(key, value, k_cache, v_cache, slot_mapping)

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
        """Causal attention of every new token; same contract as ``reference.paged_attention``.

        The C++ kernel takes the whole step in one call, each new token a row over its
        request's cache up to its own position (the new K/V are written first). A prefill
        chunk so costs its exact causal triangle: bfloat16 2.1-2.2x, float32 1.4-1.6x torch's
        fused SDPA on 64-512 token prompts (its tiles along the diagonal do masked work).
        """
        nd = meta.num_decodes
        decode_kernel_fits = query.shape[2] % 16 == 0  # its AVX-512 path needs D % 16 == 0
        if decode_kernel_fits and meta.token_block_table is not None:
            assert meta.token_context_lens is not None
            return decode_attention(
                query, k_cache, v_cache, meta.token_block_table, meta.token_context_lens, scale
            )
        out = torch.empty_like(query)  # [T, Hq, D]
        if nd and decode_kernel_fits:
            assert meta.decode_block_table is not None and meta.decode_context_lens is not None
            out[:nd] = decode_attention(
                query[:nd],
                k_cache,
                v_cache,
                meta.decode_block_table,
                meta.decode_context_lens,
                scale,
            )
        elif nd:
            out[:nd] = reference.paged_attention(
                query[:nd],
                key[:nd],
                value[:nd],
                k_cache,
                v_cache,
                dataclasses.replace(meta, num_tokens=nd, prefills=[]),
                scale,
            )
        if meta.prefills:
            num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
            flat_k = k_cache.view(-1, num_kv_heads, head_dim)  # [num_slots, Hkv, D]
            flat_v = v_cache.view(-1, num_kv_heads, head_dim)  # [num_slots, Hkv, D]
            for span in meta.prefills:
                rows = slice(span.token_start, span.token_start + span.num_new_tokens)
                out[rows] = reference._prefill_attention(
                    query[rows], key[rows], value[rows], flat_k, flat_v, span, scale
                )
        return out
