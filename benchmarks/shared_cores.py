"""Serving next to a busy neighbour: ``corefleet serve`` quiet, then beside CPU hogs, alternating.

A real node is shared. This benchmark starts one ``corefleet serve`` and, per run, measures two
phases back to back: quiet, and with ``--hogs`` busy loops (``nice -n 19`` by default) running
on the same cores. In each phase it sends ``--streams`` concurrent streamed chat completions of
``--max-tokens`` tokens (greedy, ``ignore_eos``) and reports the output tokens per second, then
one chat alone and reports its latency. Phases alternate (quiet, hogs, quiet, hogs, ...) so that
drift of the machine falls on both alike; the medians and the ratio hogs/quiet are printed.

The hogs are a neighbour's processes: each runs in a session of its own (``setsid``). With the
kernel's autogroup scheduling (on by default) a nice value only ranks tasks inside one session,
so by default (``--hog-weight equal``) each hog is weighed like the whole server, as a neighbour
pod with the same CPU weight would be: three equal groups on the cores, and the server's
fair share is about 2/3 to 1 core, whatever it asks for. An engine that uses ``C`` cores when
quiet can then keep at most about ``share / C`` of its quiet throughput; the report prints the
cores used in each phase. ``--hog-weight low`` gives each hog's autogroup the nice value too
(``/proc/PID/autogroup``): the weight of a low-priority pod (a BestEffort pod's ``cpu.weight``
is 1).

    python benchmarks/shared_cores.py --runs 5
    python benchmarks/shared_cores.py --runs 3 --serve-arg=--max-num-seqs=16 --hog-nice 0
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import psutil

sys.path.insert(0, os.path.dirname(__file__))
from soak_server import start_server, stop_server

HOG = "while :; do :; done"  # a busy loop with no memory traffic: pure CPU contention


@dataclass
class Phase:
    """One measured phase: concurrent throughput and the latency of one stream alone."""

    hogs: bool
    tokens_per_s: float
    single_s: float
    failed: int
    cores: float  # CPU time the server's processes used per second of the concurrent part


def _chat_body(model: str, max_tokens: int, index: int) -> bytes:
    prompt = f"Write a short story number {index} about a lighthouse keeper and the sea."
    return json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()


async def _one_chat(client: httpx.AsyncClient, body: bytes) -> int:
    """Stream one chat to its end; return its completion tokens (0 on any failure)."""
    tokens = 0
    headers = {"content-type": "application/json"}
    async with client.stream("POST", "/v1/chat/completions", content=body, headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            return 0
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            usage = json.loads(line[5:]).get("usage")
            if usage:
                tokens = int(usage.get("completion_tokens") or 0)
    return tokens


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` and every descendant still alive."""
    total = 0.0
    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            total += times.user + times.system
    return total


async def measure(url: str, pid: int, streams: int, max_tokens: int, hogs: bool) -> Phase:
    """``streams`` concurrent chats, then one chat alone."""
    async with httpx.AsyncClient(base_url=url, timeout=600, trust_env=False) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        bodies = [_chat_body(model, max_tokens, i) for i in range(streams)]
        cpu_before, started = _cpu_seconds(pid), time.perf_counter()
        counts = await asyncio.gather(*(_one_chat(client, b) for b in bodies))
        wall = time.perf_counter() - started
        cores = (_cpu_seconds(pid) - cpu_before) / wall
        started = time.perf_counter()
        single = await _one_chat(client, _chat_body(model, max_tokens, streams))
        single_s = time.perf_counter() - started
    failed = sum(1 for c in counts if c != max_tokens) + (single != max_tokens)
    return Phase(hogs, sum(counts) / wall, single_s, failed, cores)


@contextlib.contextmanager
def busy_neighbours(count: int, nice: int, low_weight: bool) -> Iterator[None]:
    """``count`` busy loops at ``nice``, each in its own session, killed on exit; with
    ``low_weight`` their sessions' autogroups get ``nice`` too."""
    argv = ["nice", "-n", str(nice), "sh", "-c", HOG]
    procs = [subprocess.Popen(argv, start_new_session=True) for _ in range(count)]
    try:
        if low_weight:
            for proc in procs:
                _nice_autogroup(proc.pid, nice)
        yield
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)


def _nice_autogroup(pid: int, nice: int) -> None:
    """Give ``pid``'s autogroup the nice value (no-op where autogroup scheduling is off)."""
    path = f"/proc/{pid}/autogroup"
    if os.path.exists(path):
        with open(path, "w") as f:
            f.write(str(nice))


def _median(phases: list[Phase], attr: str) -> float:
    return statistics.median(getattr(p, attr) for p in phases)


def report(phases: list[Phase], args: argparse.Namespace) -> None:
    quiet = [p for p in phases if not p.hogs]
    busy = [p for p in phases if p.hogs]
    print(
        f"\n{args.streams} streams x {args.max_tokens} tokens, {args.hogs} hogs at nice "
        f"{args.hog_nice} ({args.hog_weight} weight), median of {len(quiet)} runs"
    )
    print(f"{'phase':<8}{'tok/s':>10}{'single (s)':>12}{'cores':>7}{'failed':>8}   runs' tok/s")
    for name, group in (("quiet", quiet), ("hogs", busy)):
        runs = " ".join(f"{p.tokens_per_s:.0f}" for p in group)
        print(
            f"{name:<8}{_median(group, 'tokens_per_s'):>10.1f}{_median(group, 'single_s'):>12.2f}"
            f"{_median(group, 'cores'):>7.2f}{sum(p.failed for p in group):>8}   {runs}"
        )
    ratio = _median(busy, "tokens_per_s") / max(_median(quiet, "tokens_per_s"), 1e-9)
    slow = _median(busy, "single_s") / max(_median(quiet, "single_s"), 1e-9)
    print(f"throughput with hogs / quiet: {ratio:.2f} (target >= 0.60)")
    print(f"single-stream latency with hogs / quiet: {slow:.2f}x (target <= 2)")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", type=int, default=5, help="quiet/hogs pairs (default 5)")
    p.add_argument("--streams", type=int, default=8, help="concurrent chats (default 8)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per chat (default 64)")
    p.add_argument("--hogs", type=int, default=2, help="busy loops next to the server (2)")
    p.add_argument("--hog-nice", type=int, default=19, help="their nice value (default 19)")
    p.add_argument(
        "--hog-weight",
        choices=("low", "equal"),
        default="equal",
        help="equal: the hogs' sessions at nice 0, a neighbour with the same CPU weight "
        "(default); low: their autogroups get --hog-nice too (a low-priority pod)",
    )
    p.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        help="extra flag for corefleet serve (repeatable), e.g. --serve-arg=--max-num-seqs=16",
    )
    p.add_argument("--start-timeout", type=float, default=300.0)
    return p.parse_args()


def main() -> int:
    args = parse_args()
    proc, url, log = start_server(args.serve_arg, args.start_timeout)
    phases: list[Phase] = []
    try:
        asyncio.run(measure(url, proc.pid, args.streams, args.max_tokens, hogs=False))  # warm-up
        for run in range(args.runs):
            for hogs in (False, True):
                neighbours = busy_neighbours(
                    args.hogs if hogs else 0, args.hog_nice, args.hog_weight == "low"
                )
                with neighbours:
                    phase = asyncio.run(measure(url, proc.pid, args.streams, args.max_tokens, hogs))
                phases.append(phase)
                print(
                    f"run {run + 1} {'hogs ' if hogs else 'quiet'}: {phase.tokens_per_s:.1f} "
                    f"tok/s, single {phase.single_s:.2f} s, {phase.cores:.2f} cores, "
                    f"failed {phase.failed}",
                    flush=True,
                )
    finally:
        stop_server(proc, 30.0)
    report(phases, args)
    print(f"server log: {log}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
