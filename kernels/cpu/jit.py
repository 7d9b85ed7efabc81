"""``COREFLEET_CPU_OPS=jit``: compile the C++ CPU ops now, for this CPU (a developer's opt-in).

The engine never does this on its own: the ops ship prebuilt (``setup.py``), and an image needs
no compiler. This path is for iterating on ``csrc/`` without rebuilding every variant, and for
the start-up benchmark's "before" case. It compiles the same sources with the same common flags
as the prebuilt variants, with ``-march=native``, through ``torch.utils.cpp_extension`` (g++ and
ninja needed); torch caches the build in TORCH_EXTENSIONS_DIR (default
``~/.cache/torch_extensions``) and serialises concurrent builds with a file lock.
"""

from __future__ import annotations

import hashlib

from corefleet.kernels.cpu import variants

NATIVE = variants.Variant("native", ("-march=native",), frozenset())


def extension_name(cpu_flags: frozenset[str]) -> str:
    """The build's name in torch's cache: the sources, headers and flags (``variants.digest``;
    torch itself rebuilds on a changed ``.cpp`` but not on a changed header) and the CPU's
    flags (``-march=native`` code must not be reused on a CPU with fewer features, for example
    a home directory shared between machines)."""
    cpu = hashlib.sha256(" ".join(sorted(cpu_flags)).encode()).hexdigest()[:8]
    return f"corefleet_cpu_ops_native_{variants.digest(NATIVE)}_{cpu}"


def build_and_load(cpu_flags: frozenset[str]) -> None:
    """Compile (or reuse torch's cached build) and load it: registers ``torch.ops.corefleet_cpu``.

    Raises whatever the build raises (no ninja, no compiler, a compile error).
    """
    # Imported here: cpp_extension pulls in setuptools, which no prebuilt load needs.
    from torch.utils.cpp_extension import load

    load(
        name=extension_name(cpu_flags),
        sources=[str(path) for path in variants.sources()],
        extra_cflags=[*variants.COMMON_CFLAGS, *NATIVE.cflags],
        extra_ldflags=list(variants.LDFLAGS),
        is_python_module=False,  # registers the ops through TORCH_LIBRARY_FRAGMENT
        verbose=False,
    )
