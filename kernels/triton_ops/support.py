"""What every Triton host wrapper checks before a launch, and whether Triton can run here.

Triton compiles for GPUs. On a CPU it runs only under its interpreter, which executes each
program with numpy, one after another: that is how CI tests the kernels without a GPU.
``@triton.jit`` decides at decoration time, from ``TRITON_INTERPRET`` (read by Triton itself),
whether a kernel is compiled or interpreted, so the variable must be set before the kernel
modules are imported. The wrappers ask the kernel itself (``is_interpreted``) and pick bigger
tiles under the interpreter, whose cost is per program and per ``tl`` call, not per element.
"""

from __future__ import annotations

import importlib.util

import torch


def triton_installed() -> bool:
    """Whether ``import triton`` would succeed (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def interpreter_enabled() -> bool:
    """Whether kernels decorated from now on run in Triton's CPU interpreter."""
    import triton

    return bool(triton.knobs.runtime.interpret)


def is_interpreted(kernel: object) -> bool:
    """Whether ``kernel`` (a ``@triton.jit`` function) runs in the interpreter."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def check_launchable(kernel: object, *tensors: torch.Tensor) -> None:
    """Raise ValueError unless all tensors share one device that ``kernel`` can run on.

    A compiled kernel needs CUDA tensors (handed host pointers it would fault); an interpreted
    one runs on CPU tensors, and on CUDA tensors by copying them to the host and back.
    """
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"tensors are on different devices: {sorted(map(str, devices))}")
    device = next(iter(devices))
    if device.type == "cuda" or (device.type == "cpu" and is_interpreted(kernel)):
        return
    raise ValueError(
        f"Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 set before corefleet's Triton "
        f"kernels are imported for CPU tensors; got {device}"
    )


def interpreter_tile(num_rows: int, cap: int) -> int:
    """Rows per program under the interpreter: all of a small batch in one program, at most
    ``cap`` (a power of two). The interpreter pays for every element of a tile, masked or not,
    so a decode step's handful of rows must not be padded to a prefill-sized tile."""
    return min(cap, 1 << max(num_rows - 1, 0).bit_length())
