"""An explicit ``--kv-cache-memory`` beyond the memory there is stops the process at start with
an error naming the flag and the figures: ``corefleet serve`` before it starts any rank (exit
2, a bad argument), and a rank by itself before it loads its weights (its launcher then fails).

10 TiB: more than any machine that runs these tests has, so the refusal cannot depend on how
busy the machine is.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ABSURD = str(10 << 40)  # 10 TiB
WAIT_S = 300  # the most the test waits for the process to end (it ends in seconds)


def _corefleet(*argv: str) -> subprocess.CompletedProcess[str]:
    corefleet = Path(sys.executable).with_name("corefleet")
    return subprocess.run(
        [str(corefleet), *argv], capture_output=True, text=True, timeout=WAIT_S, check=False
    )


def _assert_names_the_figures(output: str) -> None:
    assert f"--kv-cache-memory {ABSURD} (10240.00 GiB) does not fit: this rank may use" in output
    assert "MemAvailable" in output
    assert "or leave it out to size the KV cache from the memory there is" in output


def test_serve_refuses_before_starting_a_rank() -> None:
    done = _corefleet("serve", "--port", "0", "--kv-cache-memory", ABSURD)
    assert done.returncode == 2, done.stderr
    _assert_names_the_figures(done.stderr)
    assert "started 1 local engine rank" not in done.stderr


def test_a_rank_refuses_before_loading_its_weights() -> None:
    # `generate` runs the engine as a child rank, which reads its own memory (no serve above it).
    done = _corefleet("generate", "--kv-cache-memory", ABSURD, "--prompt", "Hello")
    assert done.returncode != 0
    _assert_names_the_figures(done.stderr)
    assert "loaded " not in done.stderr  # refused before the model loaded
