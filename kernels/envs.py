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


GGUF_PACKED = "COREFLEET_GGUF_PACKED"


def gguf_packed() -> bool:
    """COREFLEET_GGUF_PACKED: whether the CPU backend repacks Q4_0/Q4_1/Q8_0 weights at load for
    its integer (AVX512-VNNI) linear, where the loaded build has it.

    ``0`` (default for now): the file's layout and the float paths (``gguf_linear``, dequantize
    + GEMM), whose greedy tokens match the float model's. ``1``: repack, and run every such
    layer on ``gguf_linear_vnni``, activations quantized per block of 32 to int8 as llama.cpp
    does (faster; SmolLM2's log-probabilities move by up to ~1 nat and 7 of 10 greedy
    continuations turn at a near tie: tests/integration/test_gguf_packed.py).
    """
    return (os.environ.get(GGUF_PACKED) or "0").strip() == "1"
