"""Shared by the GPU tier: skip a whole module, before it imports any Triton kernel, unless a
CUDA GPU is here and the kernels will be compiled natively.

The import order matters on machines without a GPU too: ``tests/gpu`` is collected before the
CPU tiers whose ``conftest.py`` sets ``TRITON_INTERPRET=1``, and a kernel module imported here
first would be compiled instead of interpreted for the whole session.
"""

from __future__ import annotations

import os

import pytest
import torch


def require_cuda() -> None:
    """Module-level skip with the reason, when there is no CUDA device or Triton interprets."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; this machine has none", allow_module_level=True)
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip(
            "TRITON_INTERPRET=1 is set: run tests/gpu in a pytest process of its own",
            allow_module_level=True,
        )
