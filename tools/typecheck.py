"""Run mypy over corefleet under its real module names (``make typecheck``).

The folders ``engine/``, ``kernels/`` and ``operator/`` are installed as ``corefleet.engine``,
``corefleet.kernels`` and ``corefleet.operator`` through setuptools' package-dir mapping, which
mypy cannot follow: run on the folders, it names the modules ``engine.*`` and every
``from corefleet... import`` becomes ``Any``, so no type crosses a module boundary. This lays the
mapping out as symlinks in ``.mypy_cache/namespace/`` (a fixed place, so mypy's cache stays
valid between runs), checks the three packages from there, and prints findings with repository
paths.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "kernels", "operator")


def main() -> int:
    root = REPO / ".mypy_cache" / "namespace"
    namespace = root / "corefleet"
    namespace.mkdir(parents=True, exist_ok=True)
    for folder in PACKAGES:
        link = namespace / folder
        if link.is_symlink() and link.readlink() != REPO / folder:
            link.unlink()  # left by a checkout at another path: check this one instead
        if not link.is_symlink():
            link.symlink_to(REPO / folder, target_is_directory=True)
    command = [sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml")]
    for folder in PACKAGES:
        command += ["-p", f"corefleet.{folder}"]
    env = {**os.environ, "MYPYPATH": str(root)}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    prefix = f"{namespace.relative_to(REPO)}{os.sep}"
    sys.stdout.write(done.stdout.replace(prefix, "").replace(f"{namespace}{os.sep}", ""))
    sys.stderr.write(done.stderr.replace(prefix, "").replace(f"{namespace}{os.sep}", ""))
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
