"""DP-wave overhead: the dummy forward passes an MoE group runs per real one.

Starts ``corefleet serve --data-parallel-size 2`` on a mixture-of-experts model (a tiny random
Qwen3-MoE written to a temporary folder, or ``--model``): its two ranks form one group that
steps in waves (``engine/engine_core/dp_proc.py``). Per run and per stream length: one greedy
stream (``ignore_eos``) goes to one rank; once the group is idle again, ``/admin/engines`` gives
each rank's steps and dummy steps since the last run. Reported, medians over ``--runs``:

- real steps (the stream's rank) and dummy steps (both ranks) per wave, and dummy per real:
  the busy rank's wave runs on to the next sync (every 32 steps) and the idle rank runs every
  step of it, so one stream of L tokens costs ``2 * ceil(L / 32) * 32 - L`` dummy passes;
- the stream's time per output token on the group and, for comparison, on one rank alone
  (``serve --data-parallel-size 1``, no group): what the dummy passes and the syncs cost it.

    python benchmarks/dp_waves.py --runs 5
    python benchmarks/dp_waves.py --model PATH --tokens 32 128 --runs 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ENGINE_FLAGS = ("--dtype", "float32", "--kv-cache-memory", str(64 << 20), "--block-size", "16")
PROMPT = "The quick brown fox jumps over the lazy dog"


@dataclass
class Wave:
    tokens: int
    real: int  # real steps (both ranks)
    dummy: int  # dummy steps (both ranks)
    s_per_token: float  # the stream's time per output token


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return json.loads(reply.read())


def _post(url: str, body: dict[str, Any]) -> Any:
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as reply:
        return json.loads(reply.read())


@contextlib.contextmanager
def _serve(model: str, ranks: int) -> Iterator[str]:
    port = _free_port()
    argv = [sys.executable, "-m", "corefleet.engine.cli", "serve", model, "--port", str(port)]
    argv += ["--data-parallel-size", str(ranks), *ENGINE_FLAGS]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            with contextlib.suppress(OSError, ValueError):
                ready = [e for e in _get(f"{base}/admin/engines") if e["state"] == "ready"]
                if len(ready) == ranks and all(e["stats"] for e in ready):
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("corefleet serve did not become ready")
            time.sleep(0.2)
        yield base
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _idle_counters(base: str, past_wave: int = -1) -> tuple[int, list[tuple[int, int]]]:
    """The wave, and (steps, dummy steps) per rank, once every rank is idle in the same wave
    (after ``past_wave``) with the same step count."""
    deadline = time.monotonic() + 60
    while True:
        stats = [e["stats"] for e in sorted(_get(f"{base}/admin/engines"), key=lambda e: e["rank"])]
        idle = all(s and not s["wave_running"] and s["current_wave"] > past_wave for s in stats)
        if idle and len({(s["current_wave"], s["steps"]) for s in stats}) == 1:
            return stats[0]["current_wave"], [(s["steps"], s["dummy_steps"]) for s in stats]
        if time.monotonic() > deadline:
            raise RuntimeError(f"the group did not go idle: {stats}")
        time.sleep(0.6)  # past a stats interval: both ranks' latest figures


def _stream_time(base: str, tokens: int) -> float:
    body = {"prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    started = time.perf_counter()
    reply = _post(f"{base}/v1/completions", body)
    assert reply["usage"]["completion_tokens"] == tokens, reply
    return (time.perf_counter() - started) / tokens


def _group_run(base: str, tokens: int) -> Wave:
    wave, before = _idle_counters(base)
    s_per_token = _stream_time(base, tokens)
    _, after = _idle_counters(base, past_wave=wave)
    steps = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    dummy = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    return Wave(tokens, steps - dummy, dummy, s_per_token)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="an MoE model folder (default: tiny)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 200])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from tests.fixtures_moe import write_tiny_moe

            model = str(write_tiny_moe(Path(tmp) / "tiny-moe"))
        group: dict[int, list[Wave]] = {n: [] for n in args.tokens}
        alone: dict[int, list[float]] = {n: [] for n in args.tokens}
        with _serve(model, 2) as base:
            _group_run(base, 8)  # warm-up
            for _ in range(args.runs):
                for n in args.tokens:
                    group[n].append(_group_run(base, n))
        with _serve(model, 1) as base:
            _stream_time(base, 8)
            for _ in range(args.runs):
                for n in args.tokens:
                    alone[n].append(_stream_time(base, n))
    print(f"model {model}, {args.runs} runs, medians (min-max of dummy per real)")
    print("| tokens | real steps | dummy steps | dummy per real | ms/token, group | alone |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in args.tokens:
        waves = group[n]
        ratios = [w.dummy / w.real for w in waves]
        print(
            f"| {n} | {statistics.median(w.real for w in waves):.0f} "
            f"| {statistics.median(w.dummy for w in waves):.0f} "
            f"| {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) "
            f"| {1000 * statistics.median(w.s_per_token for w in waves):.2f} "
            f"| {1000 * statistics.median(alone[n]):.2f} |"
        )


if __name__ == "__main__":
    main()
