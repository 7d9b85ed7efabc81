"""Which prebuilt variant of the C++ CPU ops a CPU gets (a pure function of its flags), and that
the installed package carries every variant built for this machine."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest

from corefleet.kernels.cpu import loader, variants

X86_NAMES = [v.name for v in variants.X86_64_VARIANTS]
ALL_BUILT = set(X86_NAMES)

# Flag sets as /proc/cpuinfo spells them (the relevant subset of each CPU's line).
ZEN4 = {"sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"}
ZEN4 |= {"avx512cd", "avx512_bf16", "avx512_vnni"}
SKYLAKE_SP = {"sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"}
SKYLAKE_SP |= {"avx512dq", "avx512cd"}
HASWELL = {"sse4_2", "avx", "avx2", "fma", "f16c"}
SANDY_BRIDGE = {"sse4_2", "avx"}
AVX2_NO_FMA = {"sse4_2", "avx", "avx2", "f16c"}


@pytest.mark.parametrize(
    "flags,expected",
    [
        (ZEN4, "avx512_bf16"),
        (SKYLAKE_SP, "avx512"),
        (HASWELL, "avx2"),
        (AVX2_NO_FMA, "x86_64"),
        (SANDY_BRIDGE, "x86_64"),
        (set(), "x86_64"),  # no flags known: only the baseline is safe
    ],
    ids=["zen4", "skylake-sp", "haswell", "avx2-no-fma", "sandy-bridge", "no-flags"],
)
def test_best_variant_the_cpu_supports(flags: set[str], expected: str) -> None:
    choice = variants.choose("x86_64", flags, ALL_BUILT)
    assert choice.variant is not None and choice.variant.name == expected
    assert choice.variant.cpu_flags <= flags


def test_reason_names_what_each_better_variant_lacks() -> None:
    choice = variants.choose("x86_64", SKYLAKE_SP, ALL_BUILT)
    assert choice.reason == "not avx512_bf16: the CPU lacks avx512_bf16, avx512_vnni"
    choice = variants.choose("x86_64", AVX2_NO_FMA, ALL_BUILT)
    assert "not avx2: the CPU lacks fma" in choice.reason
    assert variants.choose("x86_64", ZEN4, ALL_BUILT).reason == "the best variant"


def test_a_variant_not_built_is_passed_over() -> None:
    choice = variants.choose("x86_64", ZEN4, {"avx2", "x86_64"})
    assert choice.variant is not None and choice.variant.name == "avx2"
    assert "not avx512_bf16: not built" in choice.reason


def test_nothing_built_chooses_nothing() -> None:
    choice = variants.choose("x86_64", ZEN4, set())
    assert choice.variant is None
    assert "not x86_64: not built" in choice.reason


def test_other_architectures_get_the_generic_build() -> None:
    choice = variants.choose("aarch64", {"fp", "asimd", "sve"}, {"generic"})
    assert choice.variant is variants.GENERIC
    assert variants.choose("aarch64", {"asimd"}, ALL_BUILT).variant is None


@pytest.mark.parametrize(
    "forced,flags,built,expected",
    [
        ("avx2", ZEN4, ALL_BUILT, "avx2"),
        ("x86_64", HASWELL, ALL_BUILT, "x86_64"),
        ("avx512_bf16", HASWELL, ALL_BUILT, "lacks avx512_bf16, avx512_vnni, avx512bw"),
        ("avx512", ZEN4, {"avx2"}, "not built"),
        ("sse9", ZEN4, ALL_BUILT, "not a variant"),
    ],
)
def test_forced_variant_is_refused_unless_built_and_supported(
    forced: str, flags: set[str], built: set[str], expected: str
) -> None:
    choice = variants.choose("x86_64", flags, built, forced=forced)
    if expected in X86_NAMES:
        assert choice.variant is not None and choice.variant.name == expected
    else:
        assert choice.variant is None and expected in choice.reason


def test_cpuinfo_flags_are_those_every_processor_has() -> None:
    cpuinfo = (
        "processor\t: 0\nflags\t\t: fpu sse4_2 avx avx2 fma\n\n"
        "processor\t: 1\nflags\t\t: fpu sse4_2 avx avx2\n\n"
    )
    assert variants.parse_cpu_flags(cpuinfo) == {"fpu", "sse4_2", "avx", "avx2"}
    arm = "processor\t: 0\nFeatures\t: fp asimd evtstrm sve\n"
    assert variants.parse_cpu_flags(arm) == {"fp", "asimd", "evtstrm", "sve"}
    assert variants.parse_cpu_flags("") == frozenset()


def test_digest_covers_sources_headers_and_flags(tmp_path: Path) -> None:
    (tmp_path / "a.cpp").write_text("int a;\n")
    (tmp_path / "a.h").write_text("#pragma once\n")
    avx2 = variants.X86_64_VARIANTS[2]
    before = variants.digest(avx2, tmp_path)
    assert variants.digest(variants.X86_64_VARIANTS[3], tmp_path) != before  # other flags
    (tmp_path / "a.h").write_text("#pragma once\n// changed\n")
    assert variants.digest(avx2, tmp_path) != before
    (tmp_path / "b.cpp").write_text("int b;\n")  # a new source is built and hashed too
    assert variants.sources(tmp_path) == [tmp_path / "a.cpp", tmp_path / "b.cpp"]


def test_installed_package_carries_every_variant_for_this_machine() -> None:
    # Built by `pip install .` / `make setup` next to loader.py, named after the current sources.
    machine = platform.machine()
    built = loader.built_variants(loader.LIBRARY_DIR, machine)
    assert set(built) == {v.name for v in variants.variants_for(machine)}, (
        f"missing prebuilt variants in {loader.LIBRARY_DIR}: run `make kernels`"
    )


def test_this_cpu_reports_flags_the_choice_can_use() -> None:
    flags, source = loader.cpu_flags()
    if not Path("/proc/cpuinfo").exists():
        pytest.skip("no /proc/cpuinfo here")
    assert flags and source == "flags from /proc/cpuinfo"
    if platform.machine() == "x86_64":
        assert "sse2" in flags
