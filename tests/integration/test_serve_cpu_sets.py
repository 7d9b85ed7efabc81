"""``corefleet serve`` pins each local rank to its own cores, and refuses more ranks than cores
unless asked to share them."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from corefleet.engine.worker.cpu_allowance import format_cpu_list, parse_cpu_list
from tests.fixtures_models import write_tiny_llama
from tests.serve_support import free_port, wait_serve_ready

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        len(os.sched_getaffinity(0)) < 2, reason="needs at least 2 cores in this affinity"
    ),
]

AFFINITY = tuple(sorted(os.sched_getaffinity(0)))
ENGINE_FLAGS = ("--dtype", "float32", "--kv-cache-memory", str(8 << 20), "--block-size", "4")
# What a rank logs at start: "rank 0: 1 threads (affinity 0; cgroup quota none; request none)".
RANK_THREADS_LOG = re.compile(r"rank \d+: \d+ threads \(")
TIMEOUT_S = 240.0  # generous: a loaded 2-core CI machine loads two ranks slowly


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "m")


def serve_argv(*flags: str, port: int) -> list[str]:
    return [
        sys.executable,
        *(["-P"] if sys.version_info >= (3, 11) else []),
        *("-m", "corefleet.engine.cli", "serve", "--port", str(port), *flags, *ENGINE_FLAGS),
    ]


def env_without_cpu_settings() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("COREFLEET_CPU_THREADS", None)
    env.pop("COREFLEET_CPU_REQUEST_MILLICORES", None)
    return env


def engine_core_children(pid: int) -> list[int]:
    """The ``engine-core`` processes whose parent is ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == pid and b"engine-core" in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
    return found


def cpus_allowed(pid: int) -> tuple[int, ...]:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return parse_cpu_list(line.split(":", 1)[1].strip())
    raise AssertionError(f"no Cpus_allowed_list for {pid}")


@contextlib.contextmanager
def serving(*flags: str, log: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    port = free_port()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            serve_argv(*flags, port=port), stderr=out, env=env_without_cpu_settings()
        )
    try:
        yield proc, f"http://127.0.0.1:{port}"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0, "corefleet serve did not exit cleanly on SIGTERM"
    finally:
        proc.kill()
        proc.wait(timeout=10)


def wait_pinned(proc: subprocess.Popen[bytes], count: int, log: Path) -> list[tuple[int, ...]]:
    """The children's affinities once ``count`` of them have narrowed theirs (first thing)."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        sets: list[tuple[int, ...]] = []
        with contextlib.suppress(OSError, AssertionError):  # a child may be starting/exiting
            sets = [cpus_allowed(pid) for pid in engine_core_children(proc.pid)]
        logged = len(RANK_THREADS_LOG.findall(log.read_text()))
        if len(sets) == count and logged >= count:
            return sets
        assert proc.poll() is None, f"serve exited with {proc.returncode}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"ranks not pinned: {sets}\n{log.read_text()}"
        time.sleep(0.2)


def test_two_ranks_are_pinned_to_distinct_cores(model: Path, tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    with serving("--model", str(model), "--data-parallel-size", "2", log=log) as (proc, base):
        wait_serve_ready(proc, base, TIMEOUT_S, log)  # pinned ranks load and serve
        sets = wait_pinned(proc, 2, log)
        assert not set(sets[0]) & set(sets[1]), sets
        assert sorted(sets[0] + sets[1]) == list(AFFINITY)
        if len(AFFINITY) == 2:
            assert sorted(sets) == [(AFFINITY[0],), (AFFINITY[1],)]
        text = log.read_text()
        for rank, cpus in enumerate(
            [AFFINITY[: len(AFFINITY) // 2], AFFINITY[len(AFFINITY) // 2 :]]
        ):
            assert f"rank {rank}: {len(cpus)} threads (affinity {format_cpu_list(cpus)};" in text


def test_more_ranks_than_cores_is_refused(model: Path) -> None:
    ranks = str(len(AFFINITY) + 1)
    result = subprocess.run(
        serve_argv("--model", str(model), "--data-parallel-size", ranks, port=free_port()),
        capture_output=True,
        text=True,
        timeout=120,
        env=env_without_cpu_settings(),
    )
    assert result.returncode == 2, result.stderr
    assert f"--data-parallel-size {ranks} needs {ranks} cores" in result.stderr
    assert "--share-cores" in result.stderr


def test_share_cores_runs_every_rank_on_every_core(model: Path, tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    count = len(AFFINITY) + 1
    flags = ("--model", str(model), "--data-parallel-size", str(count), "--share-cores")
    with serving(*flags, log=log) as (proc, base):
        wait_serve_ready(proc, base, TIMEOUT_S, log)
        sets = wait_pinned(proc, count, log)
        assert sets == [AFFINITY] * count
        text = log.read_text()
        assert "sharing them with the other ranks (--share-cores)" in text
        # cores // ranks threads, at least 1, set by serve: the log says so
        assert "rank 0: 1 threads (COREFLEET_CPU_THREADS;" in text
