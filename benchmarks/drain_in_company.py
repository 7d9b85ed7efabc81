"""A rank drains next to a busy neighbour: SIGTERM one rank of ``corefleet serve`` mid-load.

Per run: ``corefleet serve --data-parallel-size 3`` (by default, on however many cores there
are: ``--share-cores`` where 3 ranks exceed them), one busy loop at nice 19 in a session of its
own (a neighbour with the same CPU weight as the server, see shared_cores.py), ``--streams``
streamed chats of ``--max-tokens`` tokens (greedy, ``ignore_eos``), and ``--term-after``
seconds into the load SIGTERM to rank 1, which drains: it finishes its requests (within the
engine's drain timeout) and exits; the coordinator sends nothing new to it. A stream counts as
failed when it does not end with all its tokens. Reported per run: failed streams, how long the
rank took from SIGTERM to exit, and how long the whole load took.

    python benchmarks/drain_in_company.py --runs 3
    python benchmarks/drain_in_company.py --runs 3 --serve-arg=--data-parallel-size=2 --hogs 0
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import sys
import time
from dataclasses import dataclass

import httpx
import psutil

sys.path.insert(0, os.path.dirname(__file__))
from shared_cores import busy_neighbours
from soak_server import start_server, stop_server


@dataclass
class Run:
    failed: int
    drain_s: float  # SIGTERM to the rank's exit
    load_s: float  # first request to the last stream's end


def _rank_process(server_pid: int, rank: int) -> psutil.Process:
    for child in psutil.Process(server_pid).children(recursive=True):
        cmdline = child.cmdline()
        if "engine-core" in cmdline and cmdline[cmdline.index("--rank") + 1] == str(rank):
            return child
    raise RuntimeError(f"no engine-core --rank {rank} under pid {server_pid}")


async def _stream(client: httpx.AsyncClient, model: str, max_tokens: int, i: int) -> bool:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"Tell story {i} about a ship in a storm."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    tokens, done = 0, False
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return False
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data:"):
                    event = json.loads(line[5:])
                    if "error" in event:
                        return False
                    tokens = int((event.get("usage") or {}).get("completion_tokens") or tokens)
    except httpx.HTTPError:
        return False
    return done and tokens == max_tokens


async def _drain_exit(rank: psutil.Process, term_after: float, timeout: float) -> float:
    await asyncio.sleep(term_after)
    rank.send_signal(signal.SIGTERM)
    started = time.perf_counter()
    deadline = started + timeout
    while rank.is_running() and rank.status() != psutil.STATUS_ZOMBIE:
        if time.perf_counter() > deadline:
            return float("inf")
        await asyncio.sleep(0.05)
    return time.perf_counter() - started


async def one_run(url: str, server_pid: int, args: argparse.Namespace) -> Run:
    async with httpx.AsyncClient(base_url=url, timeout=600, trust_env=False) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        rank = _rank_process(server_pid, 1)
        started = time.perf_counter()
        drain = asyncio.create_task(_drain_exit(rank, args.term_after, 600))
        results = await asyncio.gather(
            *(_stream(client, model, args.max_tokens, i) for i in range(args.streams))
        )
        load_s = time.perf_counter() - started
        drain_s = await drain
    return Run(sum(1 for ok in results if not ok), drain_s, load_s)


async def _all_ranks_ready(url: str, ranks: int, timeout: float) -> None:
    """Wait until the coordinator counts ``ranks`` ready ranks again (after a restart)."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(base_url=url, timeout=10, trust_env=False) as client:
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                text = (await client.get("/metrics")).text
                for line in text.splitlines():
                    ready = line.startswith('corefleet_ranks{state="ready"}')
                    if ready and float(line.split()[-1]) >= ranks:
                        return
            await asyncio.sleep(0.5)
    raise TimeoutError(f"{ranks} ranks not ready after {timeout:.0f} s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--streams", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=80)
    p.add_argument("--term-after", type=float, default=3.0, help="SIGTERM rank 1 after (s)")
    p.add_argument("--hogs", type=int, default=1, help="busy loops next to the server (1)")
    p.add_argument("--serve-arg", action="append", default=None, help="flags for serve")
    args = p.parse_args()
    flags = args.serve_arg or ["--data-parallel-size=3"]
    dp = next((int(f.split("=")[1]) for f in flags if f.startswith("--data-parallel-size")), 1)
    if dp > len(os.sched_getaffinity(0)) and "--share-cores" not in flags:
        flags.append("--share-cores")
    proc, url, log = start_server(flags, 300)
    runs: list[Run] = []
    try:
        for i in range(args.runs):
            asyncio.run(_all_ranks_ready(url, dp, 300))
            with busy_neighbours(args.hogs, 19, low_weight=False):
                run = asyncio.run(one_run(url, proc.pid, args))
            runs.append(run)
            print(
                f"run {i + 1}: failed {run.failed}/{args.streams}, rank drained in "
                f"{run.drain_s:.1f} s, load took {run.load_s:.1f} s",
                flush=True,
            )
    finally:
        stop_server(proc, 60)
    print(
        f"\nserve {' '.join(flags)}, {args.streams} streams x {args.max_tokens} tokens, "
        f"{args.hogs} nice-19 busy loop(s), SIGTERM rank 1 after {args.term_after:.0f} s"
    )
    print(f"failed streams: {sum(r.failed for r in runs)} of {args.streams * len(runs)}")
    print(f"drain (SIGTERM to exit), median: {statistics.median(r.drain_s for r in runs):.1f} s")
    print(f"load, median: {statistics.median(r.load_s for r in runs):.1f} s")
    print(f"server log: {log}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
