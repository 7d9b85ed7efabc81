"""Load the C++ CPU ops for a test module, skipping only where no C++ toolchain exists.

A machine with a compiler must build them: a compile error there fails the tests instead of
skipping them (the engine would silently fall back to the torch reference otherwise).
"""

from __future__ import annotations

import shutil

import pytest
import torch


def load_cpu_ops_or_skip() -> torch._ops._OpNamespace:
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip(
            "no C++ compiler here: the C++ CPU ops cannot be built", allow_module_level=True
        )
    from corefleet.kernels.cpu.build import load_cpu_ops

    return load_cpu_ops()
