"""``corefleet serve --data-parallel-size 2`` on a mixture-of-experts model: the two local ranks
form one group that steps in waves, restarts whole when a rank dies, and drains together.

Every request goes over HTTP to the coordinator; the ranks' wave state is read from
``/admin/engines`` (``steps``, ``dummy_steps``, ``current_wave``, ``wave_running``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from corefleet.engine import LLM, SamplingParams
from tests.fixtures_moe import write_tiny_moe
from tests.serve_support import free_port, wait_serve_ready

pytestmark = pytest.mark.slow

WAIT_S = 120.0  # generous: two ranks (re)start on a loaded 2-core machine
ENGINE_FLAGS = ("--dtype", "float32", "--kv-cache-memory", str(8 << 20), "--block-size", "4")
PROMPTS = ["Hello world", "The quick brown fox"]
LONG = 160  # tokens of a stream that must outlive a rank


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_moe(tmp_path_factory.mktemp("moe") / "m")


def _offline(model: Path, max_tokens: int) -> list[str]:
    """Greedy texts of PROMPTS from one engine in this process: no group, DP=1."""
    llm = LLM(
        str(model), multiprocess=False, dtype="float32", kv_cache_memory=8 << 20, block_size=4
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    llm.shutdown()
    return [o.outputs[0].text for o in outs]


@contextlib.contextmanager
def _serve(model: Path, log: Path) -> Iterator[str]:
    """A ready ``serve`` of two ranks (its output in ``log``); SIGTERM must exit 0."""
    port = free_port()
    argv = [
        sys.executable,
        *(["-P"] if sys.version_info >= (3, 11) else []),
        *("-m", "corefleet.engine.cli", "serve", str(model), "--port", str(port)),
        *("--data-parallel-size", "2", *ENGINE_FLAGS),
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_serve_ready(proc, base, WAIT_S, log)
        _wait_for(lambda: _group_ready(base), "both ranks ready in one group")
        yield base
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, "corefleet serve did not exit cleanly on SIGTERM"
    finally:
        proc.kill()
        proc.wait(timeout=10)


def _wait_for(probe: Callable[[], Any], what: str) -> Any:
    deadline = time.monotonic() + WAIT_S
    while True:
        with contextlib.suppress(httpx.HTTPError):
            value = probe()
            if value:
                return value
        assert time.monotonic() < deadline, f"{what}: not within {WAIT_S} s"
        time.sleep(0.1)


def _engines(base: str) -> dict[int, dict[str, Any]]:
    return {e["rank"]: e for e in httpx.get(f"{base}/admin/engines", timeout=5).json()}


def _group_ready(base: str, old_pids: tuple[int, ...] = ()) -> dict[int, dict[str, Any]] | None:
    """Both ranks ready in a group of 2 (in processes other than ``old_pids``), or None."""
    ranks = _engines(base)
    ready = [
        r
        for r in ranks.values()
        if r["state"] == "ready" and r["dp_size"] == 2 and r["pid"] not in old_pids
    ]
    return ranks if len(ready) == 2 else None


def _group_idle(base: str) -> dict[int, dict[str, Any]] | None:
    """Both ranks idle after a wave, in the same wave and with the same step count."""
    ranks = _engines(base)
    stats = [r["stats"] for r in ranks.values() if r["stats"] is not None]
    if len(stats) != 2 or any(s["wave_running"] for s in stats):
        return None
    (a, b) = stats
    same = a["current_wave"] == b["current_wave"] >= 1 and a["steps"] == b["steps"]
    return ranks if same else None


def _both_running(base: str) -> bool:
    stats = [r["stats"] for r in _engines(base).values()]
    return all(s is not None and s["running"] > 0 for s in stats)


def _complete(base: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    reply = httpx.post(f"{base}/v1/completions", json=body, timeout=WAIT_S)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]


def test_one_request_steps_both_ranks_and_equals_one_rank(model: Path, tmp_path: Path) -> None:
    expected = _offline(model, 20)
    with _serve(model, tmp_path / "serve.log") as base:
        choice = _complete(base, PROMPTS[0], 20)
        assert choice["text"] == expected[0] and choice["finish_reason"] == "length"
        # The request ran on one rank; the other ran dummy batches all along, and both went
        # idle at the same sync: equal step counters, one made only of dummy steps.
        ranks = _wait_for(lambda: _group_idle(base), "the group idle after the request")
        stats = sorted((r["stats"] for r in ranks.values()), key=lambda s: s["dummy_steps"])
        busy, idle = stats
        assert busy["steps"] == idle["steps"] >= 20 and busy["steps"] % 32 == 0
        assert idle["dummy_steps"] == idle["steps"]
        assert busy["dummy_steps"] <= busy["steps"] - 20  # its real steps: the request's
        wave = busy["current_wave"]

        # Two at once, one per rank (least-loaded): the same texts as one rank alone.
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            texts = list(pool.map(lambda p: _complete(base, p, 20)["text"], PROMPTS))
        assert texts == expected
        ranks = _wait_for(
            lambda: (r := _group_idle(base)) and r[0]["stats"]["current_wave"] > wave and r,
            "the group idle after the second wave",
        )


def _stream(base: str, prompt: str, tokens: int, started: threading.Event) -> tuple[str, str]:
    """Stream a completion; ``started`` is set once a few chunks arrived. Returns its text and
    finish reason."""
    body = {
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    text, reason, chunks = "", "", 0
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=WAIT_S) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[len("data: ") :])["choices"][0]
            text += choice["text"]
            reason = choice.get("finish_reason") or reason
            chunks += 1
            if chunks >= 5:
                started.set()
    return text, reason


def test_a_sigkilled_rank_restarts_the_group_and_streams_continue(
    model: Path, tmp_path: Path
) -> None:
    expected = _offline(model, LONG)
    log = tmp_path / "serve.log"
    with _serve(model, log) as base:
        old = _engines(base)
        events = [threading.Event() for _ in PROMPTS]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            streams = [
                pool.submit(_stream, base, prompt, LONG, event)
                for prompt, event in zip(PROMPTS, events, strict=True)
            ]
            assert all(event.wait(WAIT_S) for event in events), "the streams did not start"
            os.kill(old[1]["pid"], signal.SIGKILL)
            results = [stream.result(timeout=2 * WAIT_S) for stream in streams]
        # Both streams went on: the killed rank's and its peer's, which the group took down.
        assert results == [(text, "length") for text in expected]
        old_pids = (old[0]["pid"], old[1]["pid"])
        _wait_for(lambda: _group_ready(base, old_pids), "the group formed again")
        logged = log.read_text(errors="replace")
        assert "was killed by SIGKILL" in logged
        assert "local engine rank 0" in logged  # the peer left the lost group, restarted
        assert _complete(base, PROMPTS[0], LONG)["text"] == expected[0]  # the new group serves


def test_a_group_drained_under_load_fails_no_request(model: Path, tmp_path: Path) -> None:
    """Every request admitted completes; while no rank serves (the old group left, the new one
    loads) the API answers 503 with Retry-After, which a client retries (as OpenAI's does)."""
    log = tmp_path / "serve.log"
    with _serve(model, log) as base:
        old = _engines(base)
        old_pids = (old[0]["pid"], old[1]["pid"])
        stop = threading.Event()
        done: list[dict[str, Any]] = []
        failures: list[str] = []
        retries: list[int] = []
        body = {"max_tokens": LONG, "temperature": 0, "ignore_eos": True}

        def load(i: int) -> None:
            while not stop.is_set():
                try:
                    reply = httpx.post(
                        f"{base}/v1/completions",
                        json={**body, "prompt": PROMPTS[i % 2]},
                        timeout=WAIT_S,
                    )
                except httpx.HTTPError as exc:
                    failures.append(repr(exc))
                    continue
                if reply.status_code == 503 and "Retry-After" in reply.headers:
                    retries.append(i)  # no rank serves for now: come back shortly
                    time.sleep(0.2)
                    continue
                choice = reply.json()["choices"][0] if reply.status_code == 200 else None
                if choice is None or choice["finish_reason"] != "length":
                    failures.append(f"{reply.status_code} {reply.text}")
                done.append(reply.json())

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            workers = [pool.submit(load, i) for i in range(4)]
            _wait_for(lambda: len(done) >= 4 and _both_running(base), "both ranks busy")
            for pid in old_pids:  # as a rollout or a Ctrl-C does: every rank of the group
                os.kill(pid, signal.SIGTERM)
            _wait_for(lambda: _group_ready(base, old_pids), "the group back after its drain")
            served = len(done)
            _wait_for(lambda: len(done) >= served + 4, "load served by the new group")
            stop.set()
            for worker in workers:
                worker.result(timeout=WAIT_S)
        assert failures == []
        logged = log.read_text(errors="replace")
        for rank, pid in enumerate(old_pids):  # both drained and left together, cleanly
            assert f"local engine rank {rank} (pid {pid}) exited with code 0" in logged
        assert re.search(r"rank \d: draining [1-9]\d* request", logged), "nothing was in flight"
        assert "DPGroupLost" not in logged and "ENGINE_CORE_DEAD" not in logged


def test_an_idle_group_whose_rank_0_dies_forms_again(model: Path, tmp_path: Path) -> None:
    """No collective runs in an idle group: rank 1 learns of rank 0's death from its watcher
    (rank 0's store is gone) and exits, and the group forms again from new processes."""
    log = tmp_path / "serve.log"
    with _serve(model, log) as base:
        old = _engines(base)
        os.kill(old[0]["pid"], signal.SIGKILL)
        old_pids = (old[0]["pid"], old[1]["pid"])
        _wait_for(lambda: _group_ready(base, old_pids), "the group formed again")
        logged = log.read_text(errors="replace")
        assert "lost the data-parallel group's store" in logged
        assert f"local engine rank 1 (pid {old_pids[1]}) exited with code 1" in logged
        assert _complete(base, PROMPTS[1], 20)["finish_reason"] == "length"
