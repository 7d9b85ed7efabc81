"""The C++ CPU ops' build variants: their compiler flags, their library names, and which one a
CPU runs. The one place these are written down.

``setup.py`` builds every variant of ``csrc/*.cpp`` for the build machine's architecture into its
own shared library (``_ops_<variant>_<digest>.so`` next to this file); ``loader.py`` loads the
best one the CPU supports, and ``jit.py`` (the ``COREFLEET_CPU_OPS=jit`` developer opt-in)
compiles the same sources with the same common flags for the CPU at hand. Each library registers
the same ``torch.ops.corefleet_cpu`` ops, so one process loads exactly one of them.

Pure Python with no imports from torch or the rest of corefleet: ``setup.py`` loads this file by
path, before the package exists.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"

# No OpenMP: the ops run their loops on their own pool (csrc/parallel.h), which is why they do not
# link libgomp. Kept as a name so a change of mind is one line.
OPENMP_FLAGS: tuple[str, ...] = ()
# Every variant: optimised, no debug information (setuptools would add Python's -g: it only
# makes the build slower and the libraries larger).
COMMON_CFLAGS: tuple[str, ...] = ("-O3", "-g0", *OPENMP_FLAGS)
LDFLAGS: tuple[str, ...] = OPENMP_FLAGS

LIBRARY_PREFIX = "_ops_"
DIGEST_CHARS = 10


@dataclass(frozen=True)
class Variant:
    """One build of the ops: the instruction-set flags it is compiled with and the CPU flags
    (as ``/proc/cpuinfo`` names them) it needs at run time."""

    name: str
    cflags: tuple[str, ...]
    # Every extension ``cflags`` enables explicitly; the older ones they imply (SSE4.2 under
    # AVX, AVX under AVX2 and FMA) come with them on every CPU.
    cpu_flags: frozenset[str]


# x86-64, best first. The sources test __AVX512F__, __AVX512BW__ && __AVX512VL__,
# __AVX512BF16__ and __AVX512VNNI__ for their intrinsics paths; the rest is auto-vectorised
# for the target.
X86_64_VARIANTS: tuple[Variant, ...] = (
    Variant(
        "avx512_bf16",
        # Every CPU with AVX512-BF16 (Cooper Lake, Sapphire Rapids, Zen 4 on) has AVX512-VNNI.
        (
            "-mavx512f",
            "-mavx512bw",
            "-mavx512vl",
            "-mavx512dq",
            "-mavx512bf16",
            "-mavx512vnni",
            "-mfma",
            "-mf16c",
        ),
        frozenset(
            {
                "avx512f",
                "avx512bw",
                "avx512vl",
                "avx512dq",
                "avx512_bf16",
                "avx512_vnni",
                "fma",
                "f16c",
                "avx2",
            }
        ),
    ),
    Variant(
        "avx512",
        ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"),
        frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c", "avx2"}),
    ),
    Variant("avx2", ("-mavx2", "-mfma", "-mf16c"), frozenset({"avx2", "fma", "f16c", "avx"})),
    # Any x86-64 CPU (SSE2): the scalar paths only.
    Variant("x86_64", ("-march=x86-64",), frozenset()),
)
# Other architectures (aarch64, ...): one build for the compiler's default target.
GENERIC = Variant("generic", (), frozenset())


def variants_for(machine: str) -> tuple[Variant, ...]:
    """The variants built and loadable on ``machine`` (``platform.machine()``), best first."""
    if machine.lower() in ("x86_64", "amd64"):
        return X86_64_VARIANTS
    return (GENERIC,)


def sources(csrc: Path = CSRC) -> list[Path]:
    """Every C++ source of the ops: a new ``.cpp`` in ``csrc/`` is built with the others."""
    return sorted(csrc.glob("*.cpp"))


def digest(variant: Variant, csrc: Path = CSRC) -> str:
    """Hash of what a variant's library is built from: every source and header, and the flags.

    It is part of the library's file name, so a library built from other sources or flags (an
    editable install whose ``csrc/`` changed since) is never loaded as if it were current.
    """
    h = hashlib.sha256()
    for path in sorted([*csrc.glob("*.cpp"), *csrc.glob("*.h")]):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    h.update(" ".join((*COMMON_CFLAGS, *variant.cflags, "|", *LDFLAGS)).encode())
    return h.hexdigest()[:DIGEST_CHARS]


def library_stem(variant: Variant, csrc: Path = CSRC) -> str:
    """The library's name without ``.so``: ``_ops_<variant>_<digest>`` (setup.py's extension)."""
    return f"{LIBRARY_PREFIX}{variant.name}_{digest(variant, csrc)}"


def parse_cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The CPU flags every processor in ``/proc/cpuinfo`` reports (x86 ``flags``, Arm
    ``Features``). The intersection, so a core without a feature rules it out."""
    found: frozenset[str] | None = None
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            flags = frozenset(value.split())
            found = flags if found is None else found & flags
    return found or frozenset()


@dataclass(frozen=True)
class Choice:
    """The variant to load (None: none fits) and why, for the log."""

    variant: Variant | None
    reason: str


def choose(
    machine: str, cpu_flags: Collection[str], built: Iterable[str], forced: str | None = None
) -> Choice:
    """The best built variant whose CPU flags are all in ``cpu_flags``; a pure function.

    ``built``: the variant names with a current library. ``forced``: a variant name asked for
    (``COREFLEET_CPU_OPS``), chosen only if it is built and the CPU supports it.
    """
    present = set(built)
    candidates = variants_for(machine)
    if forced is not None:
        variant = next((v for v in candidates if v.name == forced), None)
        if variant is None:
            names = ", ".join(v.name for v in candidates)
            return Choice(None, f"{forced!r} is not a variant for {machine} (these are: {names})")
        missing = sorted(variant.cpu_flags - set(cpu_flags))
        if missing:
            return Choice(None, f"{forced} was asked for, but this CPU lacks {', '.join(missing)}")
        if forced not in present:
            return Choice(None, f"{forced} was asked for, but it is not built")
        return Choice(variant, f"{forced} was asked for (COREFLEET_CPU_OPS)")
    passed: list[str] = []
    for variant in candidates:
        missing = sorted(variant.cpu_flags - set(cpu_flags))
        if missing:
            passed.append(f"not {variant.name}: the CPU lacks {', '.join(missing)}")
        elif variant.name not in present:
            passed.append(f"not {variant.name}: not built")
        else:
            return Choice(variant, "; ".join(passed) if passed else "the best variant")
    return Choice(None, "; ".join(passed) or f"no variant for {machine}")
