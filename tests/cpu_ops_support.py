"""Load the C++ CPU ops for a test module.

They are built with the package (``make setup``), so a test run without them is a broken setup
and fails, naming the cause, rather than skipping: the engine would silently fall back to the
torch reference otherwise.
"""

from __future__ import annotations

import torch


def load_cpu_ops_or_skip() -> torch._ops._OpNamespace:
    """The ``torch.ops.corefleet_cpu`` namespace (the name is historical: it never skips)."""
    from corefleet.kernels.cpu.loader import load_cpu_ops

    return load_cpu_ops()
