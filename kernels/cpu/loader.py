"""Load the C++ CPU ops: the best prebuilt variant this CPU supports, once per process.

``setup.py`` builds one shared library per instruction-set variant (``variants.py``) when the
package is built; here the CPU's flags (``/proc/cpuinfo``) choose one, and
``torch.ops.load_library`` registers its ops under ``torch.ops.corefleet_cpu``. Nothing is
compiled at run time: a tree without a build (or with a build of other sources) raises
:class:`CpuOpsUnavailable`, and the kernel selector then runs the torch reference with a warning.
``COREFLEET_CPU_OPS`` (``kernels/envs.py``) forces a variant or opts in to compiling now (``jit``).

Why /proc/cpuinfo and not ``torch.backends.cpu.get_cpu_capability()``: torch's answer has three
levels (DEFAULT, AVX2, AVX512), cannot tell AVX512-BF16, and follows ATEN_CPU_CAPABILITY when a
user lowers torch's own dispatch. The kernel's flags list every extension, with the ones the OS
does not enable (no XSAVE state for AVX-512, say) already removed.
"""

from __future__ import annotations

import logging
import platform
import threading
import time
from pathlib import Path

import torch

from corefleet.kernels import envs
from corefleet.kernels.cpu import variants

logger = logging.getLogger(__name__)

# Where setup.py puts the libraries: next to this file, in the wheel or (editable install) in
# the source tree.
LIBRARY_DIR = Path(__file__).parent
REBUILD_HINT = (
    "build them with the package (`pip install .`; in a checkout `make setup`, or `make kernels` "
    "after changing csrc/), or set COREFLEET_CPU_OPS=jit to compile them now (needs g++, ninja)"
)

_lock = threading.Lock()
_ops: torch._ops._OpNamespace | None = None


class CpuOpsUnavailable(RuntimeError):
    """No build of the C++ CPU ops can be loaded in this process; the message says why."""


def cpu_flags() -> tuple[frozenset[str], str]:
    """This CPU's flags and where they came from (empty where /proc/cpuinfo cannot be read:
    then only a variant that needs no flags is chosen)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        return frozenset(), f"no CPU flags: /proc/cpuinfo unreadable ({exc.strerror})"
    return variants.parse_cpu_flags(text), "flags from /proc/cpuinfo"


def built_variants(library_dir: Path, machine: str) -> dict[str, Path]:
    """Variant name -> its library in ``library_dir``, for every variant built from the
    sources and flags as they are now (``variants.digest``)."""
    found: dict[str, Path] = {}
    for variant in variants.variants_for(machine):
        path = library_dir / f"{variants.library_stem(variant)}.so"
        if path.is_file():
            found[variant.name] = path
    return found


def choose_library(library_dir: Path, mode: str) -> tuple[str, Path, str]:
    """The variant to load for ``mode`` (``auto`` or a variant name), its library and why.

    Raises:
        CpuOpsUnavailable: no current build fits this CPU (or ``mode``), saying why.
    """
    machine = platform.machine()
    flags, flags_source = cpu_flags()
    built = built_variants(library_dir, machine)
    choice = variants.choose(machine, flags, built, forced=None if mode == "auto" else mode)
    if choice.variant is not None:
        name = choice.variant.name
        return name, built[name], f"{choice.reason}; {flags_source}"
    if not built:
        stale = sorted(p.name for p in library_dir.glob(f"{variants.LIBRARY_PREFIX}*.so"))
        if stale:
            raise CpuOpsUnavailable(
                f"the C++ CPU ops in {library_dir} ({', '.join(stale)}) were built from other "
                f"sources or flags than csrc/ and variants.py have now: {REBUILD_HINT}"
            )
        raise CpuOpsUnavailable(
            f"no prebuilt C++ CPU ops in {library_dir} (a source tree without a build?): "
            + REBUILD_HINT
        )
    raise CpuOpsUnavailable(f"no prebuilt C++ CPU ops variant fits: {choice.reason}")


def load_cpu_ops() -> torch._ops._OpNamespace:
    """Load the ops (the first call) and return the ``torch.ops.corefleet_cpu`` namespace.

    Logs the variant loaded and why. Raises :class:`CpuOpsUnavailable` when none fits, and
    whatever loading raises (an OSError for a library built against another torch, say);
    callers decide whether to fall back.
    """
    global _ops
    with _lock:
        if _ops is None:
            started = time.perf_counter()
            mode = envs.cpu_ops()
            if mode == "jit":
                from corefleet.kernels.cpu import jit  # imports setuptools: only when asked

                flags, _ = cpu_flags()
                jit.build_and_load(flags)
                what = "compiled for this CPU (-march=native) on COREFLEET_CPU_OPS=jit"
            else:
                name, path, reason = choose_library(LIBRARY_DIR, mode)
                # One library per process: every variant registers the same op names.
                torch.ops.load_library(str(path))
                what = f"the {name} variant ({reason}), {path}"
            _ops = torch.ops.corefleet_cpu
            logger.info("C++ CPU ops: %s, loaded in %.3f s", what, time.perf_counter() - started)
        return _ops
