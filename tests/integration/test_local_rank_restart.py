"""``corefleet serve`` watches its own ranks: one killed while loading is dead and restarted."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.engine_faults import PID_FILE_ENV
from tests.engine_proc_support import child_env
from tests.fixtures_models import write_tiny_llama
from tests.serve_support import free_port

pytestmark = pytest.mark.slow

TIMEOUT_S = 120.0  # generous: a loaded 2-core machine must pass too
ENGINE_FLAGS = ("--dtype", "float32", "--kv-cache-memory", str(8 << 20), "--block-size", "4")


def _wait_for(what: str, probe: Any) -> Any:
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        with contextlib.suppress(httpx.HTTPError, OSError, ValueError):
            value = probe()
            if value:
                return value
        assert time.monotonic() < deadline, f"{what}: not within {TIMEOUT_S} s"
        time.sleep(0.1)


def test_a_local_rank_killed_while_loading_is_dead_and_restarted(tmp_path: Path) -> None:
    model = write_tiny_llama(tmp_path / "m")
    pid_file = tmp_path / "loading.pid"
    log_path = tmp_path / "serve.log"
    port = free_port()
    env = {**os.environ, **dict(child_env(tmp_path)), PID_FILE_ENV: str(pid_file)}
    argv = [
        sys.executable,
        *(["-P"] if sys.version_info >= (3, 11) else []),
        *("-m", "corefleet.engine.cli", "serve", "--port", str(port), "--model", str(model)),
        *("--data-parallel-size", "1"),
        # Each start of the rank writes its pid to the file, then "loads" for a minute.
        *("--distributed-executor-backend", "tests.engine_faults:SlowStartExecutor"),
        *ENGINE_FLAGS,
    ]
    engines = f"http://127.0.0.1:{port}/admin/engines"

    def rank0() -> dict[str, Any] | None:
        ranks = [r for r in httpx.get(engines, timeout=2).json() if r["rank"] == 0]
        return ranks[0] if ranks else None

    rank_pids: list[int] = []
    with log_path.open("wb") as log:
        serve = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        first = int(_wait_for("the rank loads", lambda: pid_file.read_text().strip()))
        rank_pids.append(first)
        member = _wait_for("the loading rank is a member", rank0)
        assert member["pid"] == first and member["state"] == "handshaking"

        os.kill(first, signal.SIGKILL)
        restarted = _wait_for(
            "the rank restarted",
            lambda: (m := rank0()) is not None and m["pid"] != first and m,
        )
        rank_pids.append(restarted["pid"])
        assert restarted["incarnation"] > member["incarnation"]
        logged = log_path.read_text(errors="replace")
        assert "rank 0 (pod ) is gone" in logged, logged[-3000:]
        assert "was killed by SIGKILL" in logged and "starting it again in 1 s" in logged
    finally:
        serve.kill()
        serve.wait(timeout=10)
        for pid in rank_pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
