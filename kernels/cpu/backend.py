"""The ``cpu`` kernel backend: C++ ops for attention, the layer ops, small linears and argmax.

``CpuBackend`` overrides the ``KernelBackend`` methods it accelerates and hands every input its
ops do not take (another dtype, a head size the AVX-512 path cannot tile, non-contiguous
tensors) back to the torch implementations. The ops live in ``csrc/``, are built with the package
(one library per instruction-set variant) and loaded by ``loader.load_cpu_ops``; why each one
beats torch, with the measurements, is in ``docs/kernels.md``.

Attention reads K/V in place from the paged cache: the C++ op walks each row's block table and
reads only the positions below the row's context length, where the torch path gathers every
row's blocks into a padded copy. A row is one new token (a decode token, or one token of a
prefill chunk with its own length), so one call attends a whole step.
"""

from __future__ import annotations

import dataclasses

import torch

from corefleet.kernels.backend import KernelBackend
from corefleet.kernels.cpu.loader import load_cpu_ops
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


class CpuBackend(KernelBackend):
    """The C++ CPU kernels: attention in place on the paged cache (every new token of a step,
    decodes and prefill chunks alike), the fused layer ops, the KV-cache write, argmax, and a
    small-batch linear for steps of a few tokens; large batches' matmuls stay on torch (oneDNN)."""

    name = "cpu"

    def __init__(self) -> None:
        # Load now, so a missing or unloadable build surfaces at start-up (where the selector
        # can fall back) rather than in the first forward pass.
        self._ops = load_cpu_ops()

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
