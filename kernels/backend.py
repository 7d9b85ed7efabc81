"""The one place the attention implementation is chosen (once, at start-up).

The model code calls ``backend.write_kv_cache`` and ``backend.paged_attention`` and never
branches on which backend it got.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from corefleet.kernels import reference
from corefleet.kernels.metadata import AttentionMetadata

logger = logging.getLogger(__name__)


class AttentionBackend(Protocol):
    """What a paged-attention implementation provides."""

    @property
    def name(self) -> str: ...

    def write_kv_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None: ...

    def paged_attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class TorchReferenceBackend:
    """The readable torch implementation; the CPU path."""

    name: str = "torch"

    def write_kv_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        reference.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)

    def paged_attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        return reference.paged_attention(query, key, value, k_cache, v_cache, meta, scale)


def select_attention_backend(requested: str, device: torch.device) -> AttentionBackend:
    """Resolve ``--attention-backend`` (auto|torch|triton|flash-attn) for ``device``.

    auto: flash-attn if importable on CUDA, else Triton on CUDA, else the torch reference.
    """
    if requested == "auto":
        requested = "torch" if device.type != "cuda" else _best_cuda_backend()
    if requested == "torch":
        backend: AttentionBackend = TorchReferenceBackend()
    else:
        raise ValueError(
            f"attention backend {requested!r} is not available in this build; "
            "use --attention-backend torch"
        )
    logger.info("attention backend: %s on %s", backend.name, device)
    return backend


def _best_cuda_backend() -> str:
    # The Triton and flash-attn paths are not part of this build yet; CUDA runs the torch
    # reference, which is correct but not fast.
    return "torch"
