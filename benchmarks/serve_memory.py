"""Memory of ``corefleet serve``: the whole process tree's PSS and RSS once ready, and after it
has held N tokens of KV cache.

Starts ``corefleet serve`` (the embedded SmolLM2-135M-Instruct and the defaults: what
``make run`` runs, unless engine flags follow ``--``), waits for ``/ready``, measures every
process of the tree (the serve process, which is the coordinator, and its ranks and workers),
sends ``--streams`` concurrent completions of ``--tokens`` tokens each, measures again while
they are held (the KV blocks of finished requests stay in the prefix cache, so what was
written stays resident), and stops the server. ``--runs`` repeats the whole and reports the
median. ``--baseline-tree DIR`` runs an earlier corefleet source tree (``git archive`` of a
commit, with the C++ ops copied in) the same way, alternating with this one in the same run.

``--first-touch`` measures instead what writing a token's K/V costs on fresh pages of the
cache (``engine/worker/kv_allocation.py``) against pages already written: the page faults
that the old zeroing at start paid up front.

PSS (proportional set size) counts a page shared by several processes once, split between
them (torch's libraries, mapped by every process); RSS counts it in every process that maps it,
so the tree's RSS overstates what it holds. Both are read from ``/proc/PID/smaps_rollup``.

    python benchmarks/serve_memory.py --runs 3
    python benchmarks/serve_memory.py --runs 3 -- --data-parallel-size 2
    mkdir /tmp/before && git archive COMMIT | tar -x -C /tmp/before \
        && cp kernels/cpu/_ops_*.so /tmp/before/kernels/cpu/
    python benchmarks/serve_memory.py --runs 3 --baseline-tree /tmp/before
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil
from coordinator import free_port, start, stop

MiB = 1 << 20


@dataclass(frozen=True)
class TreeMemory:
    """One snapshot of the server's process tree."""

    pss: int  # bytes, shared pages split between the processes mapping them
    rss: int  # bytes, shared pages counted in every process
    processes: int
    largest_rss: int  # the largest single process (a rank, usually)


def tree_memory(root_pid: int) -> TreeMemory:
    root = psutil.Process(root_pid)
    procs = [root, *root.children(recursive=True)]
    pss = rss = largest = 0
    counted = 0
    for proc in procs:
        try:
            info = proc.memory_full_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        pss += info.pss
        rss += info.rss
        largest = max(largest, info.rss)
        counted += 1
    return TreeMemory(pss, rss, counted, largest)


def start_server(
    engine_argv: list[str], timeout_s: float, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """`corefleet serve` on a free port, once /ready answers (coordinator.py's start)."""
    port = free_port()
    corefleet = Path(sys.executable).with_name("corefleet")
    argv = [str(corefleet), "serve", "--port", str(port), *engine_argv]
    return start(argv, port, timeout_s, env), f"http://127.0.0.1:{port}"


def _completion(url: str, prompt: str, max_tokens: int) -> int:
    body = json.dumps(
        {
            "model": _model_name(url),
            "prompt": prompt,
            "max_tokens": max_tokens,
            "min_tokens": max_tokens,  # hold exactly this many: no early end of sequence
            "temperature": 0,
        }
    ).encode()
    request = urllib.request.Request(
        url + "/v1/completions", body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        usage = json.load(response)["usage"]
    return int(usage["prompt_tokens"]) + int(usage["completion_tokens"])


_MODEL_NAMES: dict[str, str] = {}


def _model_name(url: str) -> str:
    if url not in _MODEL_NAMES:
        with urllib.request.urlopen(url + "/v1/models", timeout=30) as response:
            _MODEL_NAMES[url] = json.load(response)["data"][0]["id"]
    return _MODEL_NAMES[url]


async def send_load(url: str, streams: int, tokens: int) -> int:
    """``streams`` concurrent requests, each a distinct prompt; returns the tokens they held."""
    loop = asyncio.get_running_loop()
    futures = [
        loop.run_in_executor(None, _completion, url, f"Stream {i}: tell me a story about", tokens)
        for i in range(streams)
    ]
    return sum(await asyncio.gather(*futures))


@dataclass(frozen=True)
class Run:
    ready: TreeMemory
    loaded: TreeMemory
    tokens: int  # prompt and generated tokens the load's requests held
    load_s: float  # wall time of the load (its first pass writes fresh cache pages)


def one_run(
    engine_argv: list[str],
    streams: int,
    tokens: int,
    timeout_s: float,
    env: dict[str, str] | None = None,
) -> Run:
    proc, url = start_server(engine_argv, timeout_s, env)
    try:
        time.sleep(2.0)  # let the start-up's transient buffers go (a measurement, not a test)
        ready = tree_memory(proc.pid)
        started = time.perf_counter()
        held = asyncio.run(send_load(url, streams, tokens))
        load_s = time.perf_counter() - started
        loaded = tree_memory(proc.pid)
        return Run(ready, loaded, held, load_s)
    finally:
        stop(proc)


def _gib(values: list[int]) -> str:
    return f"{statistics.median(values) / (1 << 30):.2f} GiB"


def baseline_env(tree: Path) -> dict[str, str]:
    """The environment that makes ``import corefleet`` find ``tree`` (ahead of the editable
    install, which Python's path finder consults after PYTHONPATH)."""
    shim = Path(tempfile.mkdtemp(prefix="corefleet-baseline-"))
    (shim / "corefleet").symlink_to(tree.resolve())
    return {**os.environ, "PYTHONPATH": str(shim)}


def report(name: str, runs: list[Run]) -> None:
    for i, run in enumerate(runs):
        print(
            f"{name} run {i}: ready PSS {run.ready.pss / MiB:.0f} MiB RSS "
            f"{run.ready.rss / MiB:.0f} MiB ({run.ready.processes} processes, largest RSS "
            f"{run.ready.largest_rss / MiB:.0f} MiB); after {run.tokens} tokens PSS "
            f"{run.loaded.pss / MiB:.0f} MiB RSS {run.loaded.rss / MiB:.0f} MiB (largest "
            f"{run.loaded.largest_rss / MiB:.0f} MiB); load {run.load_s:.1f} s"
        )
    print(
        f"{name}, median of {len(runs)}: ready PSS {_gib([r.ready.pss for r in runs])}, "
        f"RSS {_gib([r.ready.rss for r in runs])}; after {runs[0].tokens} tokens held: "
        f"PSS {_gib([r.loaded.pss for r in runs])}, RSS {_gib([r.loaded.rss for r in runs])}; "
        f"load {statistics.median(r.load_s for r in runs):.1f} s"
    )


def first_touch_us(layers: int = 30, kv_heads: int = 3, head_dim: int = 64) -> tuple[float, float]:
    """Microseconds to write one token's K and V in every layer (SmolLM2's float32 shape by
    default) into fresh cache pages, then into the same pages again."""
    import torch

    from corefleet.engine.worker.kv_allocation import allocate_kv_cache

    tokens = 8192
    caches = allocate_kv_cache(
        layers, (tokens // 16, 16, kv_heads, head_dim), torch.float32, torch.device("cpu")
    )
    row = torch.ones(kv_heads, head_dim)  # [Hkv, D]
    timings = []
    for _ in range(2):  # fresh pages, then the same pages written again
        started = time.perf_counter()
        for slot in range(tokens):
            for k_cache, v_cache in caches:
                k_cache.view(-1, kv_heads, head_dim)[slot].copy_(row)
                v_cache.view(-1, kv_heads, head_dim)[slot].copy_(row)
        timings.append((time.perf_counter() - started) / tokens * 1e6)
    return timings[0], timings[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--streams", type=int, default=32, help="concurrent requests")
    parser.add_argument("--tokens", type=int, default=256, help="tokens each generates")
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    parser.add_argument("--first-touch", action="store_true", help="the page-fault cost only")
    parser.add_argument(
        "--baseline-tree", type=Path, default=None, help="an earlier corefleet source tree"
    )
    parser.add_argument("engine_argv", nargs="*", help="flags for corefleet serve, after --")
    args = parser.parse_args()
    if args.first_touch:
        pairs = [first_touch_us() for _ in range(args.runs)]
        fresh = statistics.median(p[0] for p in pairs)
        again = statistics.median(p[1] for p in pairs)
        print(
            f"a token's K/V in 30 layers, median of {args.runs}: {fresh:.1f} us on fresh pages, "
            f"{again:.1f} us on written ones: {fresh - again:.1f} us of page faults a token"
        )
        return
    current: list[Run] = []
    baseline: list[Run] = []
    env = baseline_env(args.baseline_tree) if args.baseline_tree else None
    for _ in range(args.runs):
        if env is not None:
            baseline.append(
                one_run(args.engine_argv, args.streams, args.tokens, args.ready_timeout, env)
            )
        current.append(one_run(args.engine_argv, args.streams, args.tokens, args.ready_timeout))
    if baseline:
        report("baseline", baseline)
    report("current", current)


if __name__ == "__main__":
    main()
