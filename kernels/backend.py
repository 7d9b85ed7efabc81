"""The one place the kernel implementations are chosen (once, at start-up).

The model code calls ``backend.linear``, ``backend.rms_norm``, ``backend.write_kv_cache``,
``backend.paged_attention`` and the rest of the protocol below, and never branches on which
backend it got. Backends:

- ``torch``: ``reference.py``, readable torch; the oracle, and correct on any device.
- ``cpu``: the C++ CPU ops (``cpu_attention.py``), the CPU default.
- ``triton``: Triton kernels (``triton_backend.py``); on CUDA, or on CPU under
  ``TRITON_INTERPRET=1`` (tests).
- ``flash-attn``: flash-attn's varlen paged kernel for attention, Triton for the rest.

Triton and flash-attn are imported only when selected, so the engine runs without them.
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

    @property
    def needs_block_tables(self) -> bool:
        """True: attention reads ``AttentionMetadata.block_tables``/``seq_lens``/
        ``query_start_loc``; False: the torch path's decode tables, masks and prefill spans."""
        ...

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

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """``[B, V]`` -> ``[B]`` int64 with ``torch.argmax(dim=-1)``'s semantics (the first
        maximum; a row's first NaN wins): greedy sampling and the random draw end in one."""
        ...

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
    needs_block_tables: bool = False

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

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:  # [B, V] -> [B] int64
        return logits.argmax(dim=-1)

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


def select_attention_backend(
    requested: str,
    device: torch.device,
    *,
    dtype: torch.dtype | None = None,
    block_size: int | None = None,
) -> AttentionBackend:
    """Resolve ``--attention-backend`` (auto|torch|cpu|triton|flash-attn) for ``device``.

    auto on CUDA: flash-attn if importable and it fits ``dtype`` and ``block_size`` (see
    ``flash_attn_backend``), else Triton if importable, else the torch reference. auto on the
    CPU: the C++ ops ("cpu"), falling back to the torch reference (with a warning) when they
    cannot be built here.

    Raises:
        ValueError: an explicit choice that cannot run here, with the reason and what to use.
    """
    backend: AttentionBackend
    if requested == "auto" and device.type == "cpu":
        backend = _cpu_backend_or_reference()
    elif requested == "auto":
        backend = _build(_best_cuda_backend(device, dtype, block_size), device, dtype, block_size)
    else:
        backend = _build(requested, device, dtype, block_size)
    logger.info("attention backend: %s on %s", backend.name, device)
    return backend


def _build(
    name: str, device: torch.device, dtype: torch.dtype | None, block_size: int | None
) -> AttentionBackend:
    if name == "torch":
        return TorchReferenceBackend()
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention backend 'cpu' needs a CPU device, got {device}")
        from corefleet.kernels.cpu import backend as cpu_attention  # imported only when asked for

        return cpu_attention.CpuPagedAttentionBackend()
    if name == "triton":
        _check_triton(device)
        from corefleet.kernels.triton_ops.backend import TritonBackend

        return TritonBackend()
    if name == "flash-attn":
        from corefleet.kernels import flash_attn as flash_attn_backend

        reason = flash_attn_backend.flash_attn_unfit_reason(device, dtype, block_size)
        if reason is not None:
            raise ValueError(f"attention backend 'flash-attn' cannot run here: {reason}")
        _check_triton(device)  # its layer ops are the Triton kernels
        return flash_attn_backend.FlashAttnBackend()
    raise ValueError(f"unknown attention backend {name!r}")


def _check_triton(device: torch.device) -> None:
    from corefleet.kernels.triton_ops import support as triton_support

    if not triton_support.triton_installed():
        raise ValueError(
            "attention backend 'triton' needs the triton package (torch's CUDA wheels bring "
            "it; pip install triton==3.7.1); use --attention-backend torch"
        )
    if device.type == "cpu" and not triton_support.interpreter_enabled():
        raise ValueError(
            "attention backend 'triton' runs on the CPU only under Triton's interpreter "
            "(TRITON_INTERPRET=1, slow; for tests); use --attention-backend cpu or torch"
        )
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"attention backend 'triton' needs a CUDA device, got {device}")


def _cpu_backend_or_reference() -> AttentionBackend:
    # Building the C++ op needs ninja and a compiler; a machine without them still runs, on
    # the slower but dependency-free reference.
    try:
        from corefleet.kernels.cpu import backend as cpu_attention

        return cpu_attention.CpuPagedAttentionBackend()
    except Exception as exc:  # any build or load failure: fall back rather than not start
        logger.warning(
            "C++ CPU attention unavailable (%s: %s); using the torch reference backend",
            type(exc).__name__,
            exc,
        )
        return TorchReferenceBackend()


def _best_cuda_backend(
    device: torch.device, dtype: torch.dtype | None, block_size: int | None
) -> str:
    from corefleet.kernels import flash_attn as flash_attn_backend
    from corefleet.kernels.triton_ops import support as triton_support

    reason = flash_attn_backend.flash_attn_unfit_reason(device, dtype, block_size)
    if reason is None and triton_support.triton_installed():
        return "flash-attn"
    if triton_support.triton_installed():
        logger.info("not using flash-attn: %s", reason or "triton is not installed")
        return "triton"
    logger.warning("triton is not installed: CUDA runs the torch reference kernels (slow)")
    return "torch"
