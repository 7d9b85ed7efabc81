"""An explicit ``--kv-cache-memory`` beyond the memory there is stops the process at start with
an error naming the flag and the figures: ``corefleet serve`` before it starts any rank (exit
2, a bad argument), and a rank by itself before it loads its weights (its launcher then fails).
A rank started by ``corefleet serve`` sizes its cache from the serve's figure for it.

10 TiB: more than any machine that runs these tests has, so the refusal cannot depend on how
busy the machine is.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
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


def test_a_rank_takes_the_figure_its_parent_gives() -> None:
    # COREFLEET_RANK_MEMORY is how serve hands each rank its part: 1 GiB cannot hold 2 GiB.
    corefleet = Path(sys.executable).with_name("corefleet")
    done = subprocess.run(
        [str(corefleet), "generate", "--kv-cache-memory", str(2 << 30), "--prompt", "Hi"],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        check=False,
        env={**os.environ, "COREFLEET_RANK_MEMORY": str(1 << 30)},
    )
    assert done.returncode != 0
    assert (
        "does not fit: this rank may use 1.00 GiB (its part of the free memory corefleet serve "
        "found at start)" in done.stderr
    )


def test_serve_gives_its_rank_the_memory_it_found() -> None:
    corefleet = Path(sys.executable).with_name("corefleet")
    proc = subprocess.Popen(
        [str(corefleet), "serve", "--port", "0"],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    stderr = proc.stderr
    assert stderr is not None

    def read() -> None:
        for line in stderr:
            lines.put(line)

    threading.Thread(target=read, daemon=True).start()
    wanted = "(its part of the free memory corefleet serve found at start)"
    seen: list[str] = []
    try:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and not any("KV cache:" in line for line in seen):
            try:
                seen.append(lines.get(timeout=1.0))
            except queue.Empty:
                assert proc.poll() is None, "".join(seen)
        serve_line = next(line for line in seen if "memory: " in line and "rank(s)" in line)
        kv_line = next(line for line in seen if "KV cache:" in line)
        share = serve_line.split("memory: ")[1].split(" GiB")[0]
        assert f"this rank may use {share} GiB {wanted}" in kv_line
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=WAIT_S)
