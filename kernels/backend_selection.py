"""The one place a kernel backend is chosen: ``select_kernel_backend``.

It resolves ``--attention-backend`` (vLLM's name for the flag) once, at start-up. Triton and
flash-attn are imported only when selected, so the engine runs without them. Apart from
``backend.py`` (the interface the backends subclass) so that no backend imports the module that
imports it.
"""

from __future__ import annotations

import logging

import torch

from corefleet.kernels.backend import KernelBackend

logger = logging.getLogger(__name__)


def select_kernel_backend(
    requested: str,
    device: torch.device,
    *,
    dtype: torch.dtype | None = None,
    block_size: int | None = None,
) -> KernelBackend:
    """Resolve ``--attention-backend`` (auto|torch|cpu|triton|flash-attn) for ``device``.

    auto on CUDA: flash-attn if importable and it fits ``dtype`` and ``block_size`` (see
    ``flash_attn.flash_attn_unfit_reason``), else Triton if importable, else the torch
    reference. auto on the CPU: the C++ ops ("cpu"), falling back to the torch reference (with
    a warning) when no prebuilt build of them loads here.

    Raises:
        ValueError: an explicit choice that cannot run here, with the reason and what to use.
    """
    backend: KernelBackend
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
) -> KernelBackend:
    if name == "torch":
        return KernelBackend()
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention backend 'cpu' needs a CPU device, got {device}")
        from corefleet.kernels.cpu import backend as cpu_backend  # imported only when asked for

        return cpu_backend.CpuBackend()
    if name == "triton":
        _check_triton(device)
        from corefleet.kernels.triton_ops.backend import TritonBackend

        return TritonBackend()
    if name == "flash-attn":
        from corefleet.kernels import flash_attn

        reason = flash_attn.flash_attn_unfit_reason(device, dtype, block_size)
        if reason is not None:
            raise ValueError(f"attention backend 'flash-attn' cannot run here: {reason}")
        _check_triton(device)  # its layer ops are the Triton kernels
        return flash_attn.FlashAttnBackend()
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


def _cpu_backend_or_reference() -> KernelBackend:
    # The C++ ops come prebuilt with the package; a tree without a build (or a CPU no variant
    # fits) still runs, on the slower but dependency-free reference.
    try:
        from corefleet.kernels.cpu import backend as cpu_backend

        return cpu_backend.CpuBackend()
    except Exception as exc:  # any load failure: fall back rather than not start
        logger.warning(
            "C++ CPU ops unavailable (%s: %s); using the torch reference backend (slower)",
            type(exc).__name__,
            exc,
        )
        return KernelBackend()


def _best_cuda_backend(
    device: torch.device, dtype: torch.dtype | None, block_size: int | None
) -> str:
    from corefleet.kernels import flash_attn
    from corefleet.kernels.triton_ops import support as triton_support

    reason = flash_attn.flash_attn_unfit_reason(device, dtype, block_size)
    if reason is None and triton_support.triton_installed():
        return "flash-attn"
    if triton_support.triton_installed():
        logger.info("not using flash-attn: %s", reason or "triton is not installed")
        return "triton"
    logger.warning("triton is not installed: CUDA runs the torch reference kernels (slow)")
    return "torch"
