"""The one place the kernel implementations are chosen (once, at start-up).

The model code calls ``backend.linear``, ``backend.write_kv_cache`` and
``backend.paged_attention`` and never branches on which backend it got.
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
    """What a kernel backend provides: paged attention and the linear layers' matmul."""

    @property
    def name(self) -> str: ...

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor: ...

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def apply_rotary(
        self, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor: ...

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

    def linear(
        self,
        x: torch.Tensor,  # [T, K]
        weight: torch.Tensor,  # [N, K]
        bias: torch.Tensor | None,  # [N]
    ) -> torch.Tensor:  # [T, N]
        return torch.nn.functional.linear(x, weight, bias)

    def rms_norm(
        self,
        x: torch.Tensor,  # [T, H]
        weight: torch.Tensor,  # [H]
        eps: float,
        residual: torch.Tensor | None,  # [T, H]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # normed, new residual: [T, H]
        return reference.rms_norm(x, weight, eps, residual)

    def apply_rotary(
        self,
        query: torch.Tensor,  # [T, Hq, D]
        key: torch.Tensor,  # [T, Hkv, D]
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,  # [T, 1, D]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return reference.apply_rotary(query, key, cos, sin)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
        return reference.silu_and_mul(x)

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
    """Resolve ``--attention-backend`` (auto|torch|cpu|triton|flash-attn) for ``device``.

    auto: flash-attn if importable on CUDA, else Triton on CUDA, else the torch reference; on
    the CPU the C++ decode kernel ("cpu"), falling back to the torch reference (with a
    warning) when it cannot be built here.
    """
    backend: AttentionBackend
    if requested == "auto" and device.type == "cpu":
        backend = _cpu_backend_or_reference()
    elif requested == "auto":
        backend = _build(_best_cuda_backend(), device)
    else:
        backend = _build(requested, device)
    logger.info("attention backend: %s on %s", backend.name, device)
    return backend


def _build(name: str, device: torch.device) -> AttentionBackend:
    if name == "torch":
        return TorchReferenceBackend()
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention backend 'cpu' needs a CPU device, got {device}")
        from corefleet.kernels import cpu_attention  # imported only when asked for

        return cpu_attention.CpuPagedAttentionBackend()
    raise ValueError(
        f"attention backend {name!r} is not available in this build; use --attention-backend torch"
    )


def _cpu_backend_or_reference() -> AttentionBackend:
    # Building the C++ op needs ninja and a compiler; a machine without them still runs, on
    # the slower but dependency-free reference.
    try:
        from corefleet.kernels import cpu_attention

        return cpu_attention.CpuPagedAttentionBackend()
    except Exception as exc:  # any build or load failure: fall back rather than not start
        logger.warning(
            "C++ CPU attention unavailable (%s: %s); using the torch reference backend",
            type(exc).__name__,
            exc,
        )
        return TorchReferenceBackend()


def _best_cuda_backend() -> str:
    # The Triton and flash-attn paths are not part of this build yet; CUDA runs the torch
    # reference, which is correct but not fast.
    return "torch"
