"""Every environment variable the kernels read, in one place, read when asked for.

The engine's own variables are in ``engine/envs.py``; the kernels never import the engine.
"""

from __future__ import annotations

import os

CPU_OPS = "COREFLEET_CPU_OPS"


def cpu_ops() -> str:
    """COREFLEET_CPU_OPS: which build of the C++ CPU ops a process loads.

    ``auto`` (default): the best prebuilt variant this CPU supports. A variant's name
    (``avx512_bf16``, ``avx512``, ``avx2``, ``x86_64``; ``generic`` off x86): that one, refused
    if the CPU lacks its instructions. ``jit``: a developer's opt-in to compile ``csrc/`` now
    for this CPU (``-march=native``; needs g++ and ninja, 20-45 s on 2 cores, then cached in
    TORCH_EXTENSIONS_DIR).
    """
    return (os.environ.get(CPU_OPS) or "auto").strip().lower()
