"""The flash-attn backend: FlashAttention's varlen paged kernel for attention, Triton for the rest.

Chosen by ``select_kernel_backend`` (``--attention-backend flash-attn``, or ``auto`` on CUDA
when the ``flash_attn`` package imports and the engine's settings fit it). One
``flash_attn_varlen_func`` call covers the whole mixed batch: ``block_table`` points it at the
paged cache, ``cu_seqlens_q`` splits the flattened query rows by request, and ``causal=True``
aligns each request's mask to the bottom right (query ``j`` of ``q_len`` sees the keys up to
position ``seq_len - q_len + j``), exactly the engine's contract.

Limits of flash-attn 2's paged path, checked at start-up (``flash_attn_unfit_reason``): float16 or
bfloat16 only, and a KV block size that is a multiple of 256 tokens.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import torch

from corefleet.kernels.metadata import AttentionMetadata
from corefleet.kernels.triton_ops.backend import TritonBackend, require_block_tables

FLASH_ATTN_DTYPES = (torch.float16, torch.bfloat16)
FLASH_ATTN_PAGE_MULTIPLE = 256  # flash-attn 2: "paged KV cache block size must be divisible by 256"


def flash_attn_installed() -> bool:
    """Whether the ``flash_attn`` package is importable (checked without importing it)."""
    return importlib.util.find_spec("flash_attn") is not None


def flash_attn_unfit_reason(
    device: torch.device, dtype: torch.dtype | None, block_size: int | None
) -> str | None:
    """Why flash-attn cannot run this engine, or None if it can."""
    if device.type != "cuda":
        return f"flash-attn needs a CUDA device, got {device}"
    if not flash_attn_installed():
        return "the flash_attn package is not installed"
    if dtype is not None and dtype not in FLASH_ATTN_DTYPES:
        return f"flash-attn runs float16 or bfloat16, not {dtype}"
    if block_size is not None and block_size % FLASH_ATTN_PAGE_MULTIPLE:
        return (
            f"flash-attn 2's paged kernel needs --block-size a multiple of "
            f"{FLASH_ATTN_PAGE_MULTIPLE}, got {block_size}"
        )
    return None


class FlashAttnBackend(TritonBackend):
    """flash-attn's ``flash_attn_varlen_func`` over block tables; the Triton layer kernels."""

    name = "flash-attn"

    def __init__(self) -> None:
        module: Any = importlib.import_module("flash_attn")
        self._varlen = module.flash_attn_varlen_func

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
        """Every new token over its request's cache, prefill and decode in one call."""
        block_tables, seq_lens, query_start_loc = require_block_tables(meta)
        # With a block table, flash-attn reads each request's key count from cu_seqlens_k.
        cu_seqlens_k = torch.nn.functional.pad(
            torch.cumsum(seq_lens, 0, dtype=torch.int32), (1, 0)
        )  # [R + 1] int32
        out: torch.Tensor = self._varlen(
            query,
            k_cache,
            v_cache,
            cu_seqlens_q=query_start_loc,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=meta.max_query_len,
            max_seqlen_k=meta.max_seq_len,
            softmax_scale=scale,
            causal=True,
            block_table=block_tables,
        )
        return out
