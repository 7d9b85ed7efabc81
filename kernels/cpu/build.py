"""Build and load every C++ CPU op in ``csrc/``: paged attention, the small-batch linear, the
fused layer ops (RMSNorm, rotary, SiLU-and-mul), the KV-cache write and the row-wise argmax.

All sources compile into one extension at first use with ``torch.utils.cpp_extension`` (ninja
and a C++ compiler are needed) and register under ``torch.ops.corefleet_cpu``. The build is
cached twice: once per process here, and across processes by torch in
``~/.cache/torch_extensions`` (torch serialises concurrent builds with a file lock and
rebuilds when a source changes).
"""

from __future__ import annotations

import hashlib
import logging
import platform
import threading
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = sorted(_CSRC.glob("*.cpp"))
# -march=native: the kernels rely on AVX-512 intrinsics or auto-vectorisation where present.
# -fopenmp: at::parallel_for is a header template; without OpenMP it silently runs serially.
# The extension links libgomp.so.1 by soname, so it shares the pool torch already loaded.
_CFLAGS = ["-O3", "-march=native", "-fopenmp"]
_LDFLAGS = ["-fopenmp"]

_lock = threading.Lock()
_ops: torch._ops._OpNamespace | None = None


def _extension_name() -> str:
    """Build name keyed by the CPU's feature flags and the shared headers.

    ``-march=native`` code must not be reused on a CPU with fewer features (for example a
    home directory shared between machines), and torch's build cache is keyed by name. torch
    rebuilds when a source changes but does not look at included headers: their content is
    part of the name instead.
    """
    flags = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line
                break
    except OSError:
        pass
    digest = hashlib.sha1(flags.encode())
    for header in sorted(_CSRC.glob("*.h")):
        digest.update(header.read_bytes())
    return "corefleet_cpu_ops_" + digest.hexdigest()[:10]


def load_cpu_ops() -> torch._ops._OpNamespace:
    """Compile (or reuse) the extension and return the ``torch.ops.corefleet_cpu`` namespace.

    Raises whatever the build raises (no ninja, no compiler, compile error); callers decide
    whether to fall back.
    """
    global _ops
    with _lock:
        if _ops is None:
            # Imported lazily: cpp_extension pulls in setuptools, which engines that never use
            # these ops should not pay for.
            from torch.utils.cpp_extension import load

            started = time.perf_counter()
            load(
                name=_extension_name(),
                sources=[str(path) for path in _SOURCES],
                extra_cflags=_CFLAGS,
                extra_ldflags=_LDFLAGS,
                is_python_module=False,  # registers the ops through TORCH_LIBRARY_FRAGMENT
                verbose=False,
            )
            _ops = torch.ops.corefleet_cpu
            logger.info("C++ CPU ops ready in %.1f s", time.perf_counter() - started)
        return _ops
