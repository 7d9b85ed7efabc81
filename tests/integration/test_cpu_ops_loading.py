"""The prebuilt C++ CPU ops in fresh processes, as the engine loads them: the best variant for
this CPU with no compiler anywhere, each variant the CPU can run giving the reference's answers,
the torch reference (with a warning) where no current build exists, and the JIT opt-in.

Each case runs tests/cpu_ops_probe.py, which selects the backend with
``select_kernel_backend("auto")`` and checks every op family against the torch reference.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from corefleet.kernels.cpu import loader, variants

pytestmark = pytest.mark.slow

PROBE = Path(__file__).resolve().parents[1] / "cpu_ops_probe.py"
TOLERANCE = {"torch.float32": 1e-5, "torch.bfloat16": 2e-2}
MACHINE = platform.machine()
CPU_FLAGS, _ = loader.cpu_flags()


def _probe(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None, compiles: bool = False
) -> tuple[dict[str, object], str]:
    """Run the probe with no compiler on PATH (unless ``env`` sets one) and an empty torch
    extensions folder; returns its JSON answer and its log. Unless ``compiles``, fails if
    anything was written to that folder."""
    no_tools = tmp_path / "bin"  # PATH without g++, c++, cc or ninja
    no_tools.mkdir(exist_ok=True)
    extensions = tmp_path / "torch_extensions"
    extensions.mkdir(exist_ok=True)
    base = {k: v for k, v in os.environ.items() if k not in ("CC", "CXX", "COREFLEET_CPU_OPS")}
    run_env = {**base, "PATH": str(no_tools), "TORCH_EXTENSIONS_DIR": str(extensions)}
    done = subprocess.run(
        [sys.executable, str(PROBE), *args],
        env={**run_env, **(env or {})},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    if not compiles:
        assert not any(extensions.iterdir()), "something was compiled at run time"
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def _assert_matches_reference(result: dict[str, object]) -> None:
    assert result["backend"] == "cpu"
    errors = result["errors"]
    assert isinstance(errors, dict)
    for dtype, by_op in errors.items():
        for op, error in by_op.items():
            assert error <= (0 if op == "argmax" else TOLERANCE[dtype]), (dtype, op, error)


def test_auto_loads_the_best_prebuilt_variant_without_a_compiler(tmp_path: Path) -> None:
    built = loader.built_variants(loader.LIBRARY_DIR, MACHINE)
    expected = variants.choose(MACHINE, CPU_FLAGS, built).variant
    assert expected is not None, "no prebuilt variant fits this CPU"
    result, log = _probe(tmp_path)
    _assert_matches_reference(result)
    assert result["libraries"] == [str(built[expected.name])]
    assert f"C++ CPU ops: the {expected.name} variant" in log


@pytest.mark.parametrize("variant", variants.variants_for(MACHINE), ids=lambda v: v.name)
def test_each_variant_the_cpu_runs_matches_the_reference(
    tmp_path: Path, variant: variants.Variant
) -> None:
    missing = variant.cpu_flags - CPU_FLAGS
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(sorted(missing))}")
    result, log = _probe(tmp_path, env={"COREFLEET_CPU_OPS": variant.name})
    _assert_matches_reference(result)
    assert result["libraries"] == [str(loader.LIBRARY_DIR / f"{variants.library_stem(variant)}.so")]
    assert f"{variant.name} was asked for" in log


def test_no_build_runs_the_torch_reference_with_a_warning(tmp_path: Path) -> None:
    # A source tree without a build: the loader's folder holds no library at all.
    empty = tmp_path / "no_build"
    empty.mkdir()
    result, log = _probe(tmp_path, "--library-dir", str(empty))
    assert result == {"backend": "torch", "libraries": []}
    assert "WARNING" in log and f"no prebuilt C++ CPU ops in {empty}" in log
    assert "using the torch reference backend" in log


def test_a_build_of_other_sources_is_not_loaded(tmp_path: Path) -> None:
    # An editable install whose csrc/ changed since its build: the libraries carry the old digest.
    stale = tmp_path / "stale"
    stale.mkdir()
    for path in loader.built_variants(loader.LIBRARY_DIR, MACHINE).values():
        old_name = path.name.rsplit("_", 1)[0] + "_0000000000.so"
        shutil.copy(path, stale / old_name)
    result, log = _probe(tmp_path, "--library-dir", str(stale))
    assert result == {"backend": "torch", "libraries": []}
    assert "were built from other sources or flags" in log and "make kernels" in log


def test_jit_opt_in_compiles_for_this_cpu(tmp_path: Path) -> None:
    # The developer's opt-in (and the start-up benchmark's "before"): needs a compiler and ninja.
    compiler = shutil.which("c++")
    ninja = shutil.which("ninja") or shutil.which("ninja", path=str(Path(sys.executable).parent))
    if compiler is None or ninja is None:
        pytest.skip("COREFLEET_CPU_OPS=jit needs a C++ compiler and ninja")
    tools = f"{Path(ninja).parent}{os.pathsep}{Path(compiler).parent}"
    result, log = _probe(tmp_path, env={"COREFLEET_CPU_OPS": "jit", "PATH": tools}, compiles=True)
    _assert_matches_reference(result)
    (library,) = result["libraries"]  # type: ignore[misc]
    assert str(library).startswith(str(tmp_path / "torch_extensions"))
    assert "compiled for this CPU (-march=native) on COREFLEET_CPU_OPS=jit" in log
