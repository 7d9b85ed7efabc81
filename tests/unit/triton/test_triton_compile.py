"""Every Triton kernel compiles to a cubin for an sm_90 GPU, here, without a GPU.

Runs ``compile_for_gpu.py`` in a child process: the kernels in this process are interpreted
(``conftest.py``), and only un-interpreted ones go through Triton's GPU code generation.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_kernels_compile_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("compile_for_gpu.py")
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("ok ") >= 18, done.stdout
