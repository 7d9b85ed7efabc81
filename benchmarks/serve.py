"""Serving benchmark: latency and throughput of ``corefleet serve`` over its OpenAI API.

Starts ``corefleet serve`` (or targets ``--base-url``), sends streamed ``/v1/completions``
requests with random token-id prompts (seeded, ``ignore_eos``, greedy) at Poisson request rates
and reports per rate: completed/failed requests, req/s, output tok/s, TTFT / TPOT / ITL / E2E
p50 and p99. Then the saturation comparison: per run, offline ``LLM.generate`` of the same
prompts with the same engine flags (all submitted at once), and the server at rate inf; the
median serve/offline ratio is set against the 90 % target. The two never run at the same time.
CPU use of the client, coordinator and engine processes is read from /proc during each load.

    python benchmarks/serve.py --dtype float32 --runs 3
    python benchmarks/serve.py --base-url http://127.0.0.1:8000 --request-rates 2 inf
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np

from corefleet.engine import LLM, SamplingParams
from corefleet.engine.config import EngineConfig
from corefleet.engine.engine_args import (
    add_engine_args,
    engine_argv_from_config,
    engine_kwargs_from_args,
)
from corefleet.engine.models.loader import load_arch_config, resolve_model_path

TICK = os.sysconf("SC_CLK_TCK")


@dataclass
class RequestResult:
    ok: bool = False
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    itls: list[float] = field(default_factory=list)
    error: str = ""


# -- /proc CPU accounting ---------------------------------------------------------------------
def _cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def _descendants(pid: int) -> list[int]:
    todo, seen = [pid], []
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            with contextlib.suppress(OSError):
                kids = [int(c) for c in (task / "children").read_text().split()]
                seen += kids
                todo += kids
    return seen


def cpu_snapshot(front_pid: int | None) -> dict[str, float]:
    """CPU seconds of this process (client), the server (coordinator), its descendants (engine
    ranks; offline: this process's descendants) and of the rest of the machine (other)."""
    root = front_pid if front_pid is not None else os.getpid()
    snap = {
        "client": time.process_time(),
        "coordinator": _cpu_s(front_pid) if front_pid is not None else 0.0,
        "engines": sum(map(_cpu_s, _descendants(root))),
    }
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    busy = (sum(ticks[:8]) - ticks[3] - ticks[4]) / TICK  # all but idle and iowait
    snap["other"] = busy - sum(snap.values())  # processes not ours: a busy machine
    return snap


def cpu_cores(before: dict[str, float], after: dict[str, float], wall: float) -> dict[str, float]:
    return {k: (after[k] - before[k]) / wall for k in before}


# -- load generation --------------------------------------------------------------------------
async def one_request(
    session: aiohttp.ClientSession, url: str, prompt: list[int], output_len: int
) -> RequestResult:
    body = {
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    res, chunks = RequestResult(), 0
    start = last = time.perf_counter()
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if event.get("usage"):
                    res.output_tokens = event["usage"]["completion_tokens"]
                if event.get("choices"):
                    now = time.perf_counter()
                    if chunks == 0:
                        res.ttft = now - start
                    else:
                        res.itls.append(now - last)
                    chunks, last = chunks + 1, now
        res.e2e = time.perf_counter() - start
        res.output_tokens = res.output_tokens or chunks
        res.ok = res.output_tokens == output_len
        if not res.ok:
            res.error = f"{res.output_tokens} output tokens, expected {output_len}"
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
        res.error = repr(exc)
    return res


async def run_load(
    base_url: str,
    prompts: list[list[int]],
    output_len: int,
    rate: float,
    max_concurrency: int | None,
    seed: int,
) -> tuple[list[RequestResult], float]:
    """Send every prompt with Poisson arrivals at ``rate`` req/s (inf: all at once), at most
    ``max_concurrency`` in flight; returns the results and the wall time."""
    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency or len(prompts))
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    url = base_url.rstrip("/") + "/v1/completions"

    async def limited(session: aiohttp.ClientSession, p: list[int]) -> RequestResult:
        async with limit:
            return await one_request(session, url, p, output_len)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks = []
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            if i and not math.isinf(rate):
                await asyncio.sleep(rng.expovariate(rate))
            tasks.append(asyncio.create_task(limited(session, p)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - t0


def summarize(results: list[RequestResult], wall: float) -> dict[str, float]:
    ok = [r for r in results if r.ok]
    ms = 1000.0
    pct = lambda xs, q: float(np.percentile(xs, q)) * ms if xs else float("nan")  # noqa: E731
    ttft, e2e = [r.ttft for r in ok], [r.e2e for r in ok]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [x for r in ok for x in r.itls]
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "req_s": len(ok) / wall,
        "out_tok_s": sum(r.output_tokens for r in ok) / wall,
        **{
            f"{name}_p{q}": pct(xs, q)
            for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", e2e))
            for q in (50, 99)
        },
    }


# -- server and offline -----------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(engine_argv: list[str], dp: int, timeout: float) -> tuple[subprocess.Popen, str]:
    port = free_port()
    argv = [sys.executable, "-m", "corefleet.engine.cli", "serve", *engine_argv]
    argv += ["--data-parallel-size", str(dp), "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"corefleet serve exited with {proc.returncode}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url + "/ready", timeout=2):
            return proc, url  # 200 (503 raises HTTPError, an OSError)
        time.sleep(0.25)
    stop_server(proc)
    raise TimeoutError(f"/ready not 200 after {timeout:.0f} s")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def offline_run(
    engine_kwargs: dict[str, object], dp: int, prompts: list[list[int]], output_len: int
) -> tuple[float, dict[str, float]]:
    """Output tok/s of ``LLM.generate`` over ``dp`` engines (prompts dealt round-robin, one
    thread each), all prompts submitted at once; plus the CPU cores used."""
    llms = [LLM(**engine_kwargs) for _ in range(dp)]  # type: ignore[arg-type]
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    shards = [[{"prompt_token_ids": p} for p in prompts[i::dp]] for i in range(dp)]
    counts = [0] * dp

    def work(i: int) -> None:
        outs = llms[i].generate(shards[i], params, use_tqdm=False)
        counts[i] = sum(len(o.outputs[0].token_ids) for o in outs)

    try:
        for llm in llms:  # warm-up
            llm.generate([{"prompt_token_ids": prompts[0]}] * 2, params, use_tqdm=False)
        before, t0 = cpu_snapshot(None), time.perf_counter()
        with ThreadPoolExecutor(dp) as pool:
            list(pool.map(work, range(dp)))
        wall = time.perf_counter() - t0
        cores = cpu_cores(before, cpu_snapshot(None), wall)
    finally:
        for llm in llms:
            llm.shutdown()
    assert sum(counts) == len(prompts) * output_len, "every request must give output_len tokens"
    return sum(counts) / wall, cores


def serve_load(
    url: str, pid: int | None, prompts: list[list[int]], args: argparse.Namespace, rate: float
) -> tuple[dict[str, float], dict[str, float]]:
    before = cpu_snapshot(pid)
    results, wall = asyncio.run(
        run_load(url, prompts, args.output_len, rate, args.max_concurrency, args.random_seed)
    )
    cores = cpu_cores(before, cpu_snapshot(pid), wall)
    for err in sorted({r.error for r in results if not r.ok})[:3]:
        print(f"  failed request: {err}", file=sys.stderr)
    return summarize(results, wall), cores


def fmt_cores(c: dict[str, float]) -> str:
    return " ".join(f"{k} {v:.2f}" for k, v in c.items())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Engine flags (below, as for `corefleet serve`) apply to the server and to the "
        "offline LLM alike.",
    )
    b = parser.add_argument_group("benchmark")
    b.add_argument("--base-url", default=None, help="target this running server (no offline)")
    b.add_argument("--data-parallel-size", type=int, default=1, help="engine ranks (default 1)")
    b.add_argument("--input-len", type=int, default=128, help="prompt tokens (default 128)")
    b.add_argument("--output-len", type=int, default=64, help="output tokens (default 64)")
    b.add_argument("--num-prompts", type=int, default=32, help="requests per rate (default 32)")
    b.add_argument(
        "--request-rates",
        nargs="+",
        type=float,
        default=[1.0, 2.0, 4.0, math.inf],
        help="Poisson request rates in req/s; inf sends all at once (default: 1 2 4 inf)",
    )
    b.add_argument("--max-concurrency", type=int, help="most requests in flight (default: all)")
    b.add_argument(
        "--saturation-prompts",
        type=int,
        default=64,
        help="requests of the saturation comparison (rate inf; 0 skips it; default 64)",
    )
    b.add_argument("--runs", type=int, default=3, help="saturation runs, median (default 3)")
    b.add_argument("--random-seed", type=int, default=0, help="workload seed (default 0)")
    b.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait /ready")
    b.add_argument("--json", type=Path, default=None, help="also write the figures here")
    add_engine_args(parser)
    args = parser.parse_args()

    engine_kwargs = engine_kwargs_from_args(args)
    engine_argv = engine_argv_from_config(EngineConfig.from_kwargs(**engine_kwargs))
    vocab = load_arch_config(resolve_model_path(args.model)).vocab_size
    rng = random.Random(args.random_seed)
    n_max = max(args.num_prompts, args.saturation_prompts)
    prompts = [
        [rng.randrange(100, vocab - 100) for _ in range(args.input_len)] for _ in range(n_max)
    ]
    sat_prompts = prompts[: args.saturation_prompts]
    dp, runs = args.data_parallel_size, args.runs if args.base_url is None else 1
    out: dict[str, object] = {"args": {k: str(v) for k, v in vars(args).items()}, "rates": {}}
    sat: list[tuple[float, float]] = []

    for run in range(runs):
        offline: float | None = None
        if args.base_url is None and sat_prompts:
            offline, cores = offline_run(engine_kwargs, dp, sat_prompts, args.output_len)
            print(f"run {run + 1}: offline {offline:.1f} tok/s (cores: {fmt_cores(cores)})")
            out[f"offline_cores_{run}"] = cores
        proc, url = (None, args.base_url)
        try:
            if args.base_url is None:
                proc, url = start_server(engine_argv, dp, args.ready_timeout)
            pid = proc.pid if proc else None
            asyncio.run(run_load(url, prompts[:2], args.output_len, math.inf, None, 0))  # warm-up
            if sat_prompts:
                s, cores = serve_load(url, pid, sat_prompts, args, math.inf)
                print(
                    f"run {run + 1}: serve {s['out_tok_s']:.1f} tok/s, failed {s['failed']} "
                    f"(cores: {fmt_cores(cores)})"
                )
                out[f"serve_cores_{run}"] = cores
                if offline is not None:
                    sat.append((s["out_tok_s"], offline))
            if run == 0:
                for rate in args.request_rates:
                    s, cores = serve_load(url, pid, prompts[: args.num_prompts], args, rate)
                    out["rates"][str(rate)] = {**s, "cores": cores}  # type: ignore[index]
                    print(f"rate {rate}: {s['out_tok_s']:.1f} tok/s (cores: {fmt_cores(cores)})")
        except BaseException:
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # on error: server and engines, no drain
            raise
        finally:
            if proc is not None:
                stop_server(proc)

    print(
        f"\nrandom prompts {args.input_len} -> {args.output_len} tokens, "
        f"{args.num_prompts} per rate, DP={dp}, dtype {args.dtype}"
    )
    cols = ["ttft", "tpot", "itl", "e2e"]
    head = "| rate (req/s) | done / failed | req/s | out tok/s |"
    head += "".join(f" {c.upper()} p50 / p99 (ms) |" for c in cols)
    head += " CPU cores client / coord / engines / other |"
    print(head + "\n|" + "---:|" * (5 + len(cols)))
    for rate, s in out["rates"].items():  # type: ignore[union-attr]
        row = f"| {rate} | {s['completed']} / {s['failed']} | {s['req_s']:.2f} | "
        row += f"{s['out_tok_s']:.1f} |"
        row += "".join(f" {s[c + '_p50']:.0f} / {s[c + '_p99']:.0f} |" for c in cols)
        row += " " + " / ".join(f"{v:.2f}" for v in s["cores"].values()) + " |"
        print(row)
    if sat:
        serve_med = statistics.median(x for x, _ in sat)
        off_med = statistics.median(y for _, y in sat)
        ratio = statistics.median(x / y for x, y in sat)  # per run: offline and serve adjacent
        out.update(saturation_runs=sat, serve_tok_s=serve_med, offline_tok_s=off_med, ratio=ratio)
        runs_txt = " / ".join(f"{x:.1f} vs {y:.1f}" for x, y in sat)
        print(
            f"\nsaturation ({len(sat_prompts)} prompts at once), median of {len(sat)} runs: "
            f"serve {serve_med:.1f} tok/s, offline {off_med:.1f} tok/s; serve/offline (median "
            f"of per-run ratios) {ratio:.1%}: {'meets' if ratio >= 0.9 else 'misses'} the 90 % "
            f"target (runs, serve vs offline: {runs_txt})"
        )
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, default=str))


if __name__ == "__main__":
    main()
