"""Soak benchmark: ``corefleet serve`` held beyond saturation with a mixed, partly hostile load.

Starts ``corefleet serve`` on a free loopback port (default: the embedded model; serve flags
via ``--serve-arg=FLAG`` or after ``--``), or targets ``--url``. Phase 1 measures the saturation
rate: a closed loop of ``--saturation-concurrency`` clients for ``--saturation-duration`` s,
completed requests per second in three equal windows, the median (skipped with ``--rate``).
Phase 2 sends Poisson arrivals at ``--rate-factor`` x that rate for ``--duration`` s: chat and
completions, about half streamed, 10 % of clients disconnecting after a chunk or two, 1 %
malformed bodies (see ``soak_load.py``). Meanwhile the RSS of the coordinator and of every
engine-core child is sampled. Reported: answers by class (2xx, 429, other 4xx, 5xx, transport
errors) for well-formed and malformed requests, TTFT / E2E p50 and p99 and tokens/s of the
admitted requests, RSS after warm-up (``--warmup-fraction`` of the duration) and at the end.

PASS needs: no 5xx; every well-formed request answered 200 (whole, or closed by the client on
purpose) or 429; every 429 with ``Retry-After``; every malformed body a 4xx; RSS growth below
``--rss-growth-limit`` % per process. Exit code 1 on FAIL.

    python benchmarks/soak.py --json soak.json
    python benchmarks/soak.py --duration 60 --serve-arg=--max-model-len=512
    python benchmarks/soak.py --duration 120 -- --max-model-len 512 --max-num-seqs 32
    python benchmarks/soak.py --url http://127.0.0.1:8000 --pid 1234 --rate 4
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import random
import resource
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from soak_load import Outcome, RequestMix, RequestSpec, send, tally
from soak_server import RssSampler, start_server, stop_server


# -- phases -----------------------------------------------------------------------------------
def client_for(url: str, connections: int, timeout: float) -> httpx.AsyncClient:
    """An httpx client with a pool of ``connections``; every wait bounded by ``timeout``."""
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(
        base_url=url,
        limits=limits,
        timeout=httpx.Timeout(timeout, connect=10.0),
        trust_env=False,
    )


def make_mix(args: argparse.Namespace, seed: int) -> RequestMix:
    return RequestMix(
        seed,
        (args.max_tokens[0], args.max_tokens[1]),
        args.stream_fraction,
        args.disconnect_fraction,
        args.malformed_fraction,
        args.huge_n,
        args.model,
    )


async def saturation(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """Closed loop of well-formed requests (no disconnects): completed req/s, median of 3."""
    n, span = args.saturation_concurrency, args.saturation_duration
    print(f"saturation: closed loop of {n} clients for {span:.0f} s", flush=True)
    mix = make_mix(args, args.seed + 1)
    done_at: list[float] = []
    others: list[float] = []
    async with client_for(url, n, args.request_timeout) as client:
        warm = [send(client, mix.well_formed(False), args.request_timeout) for _ in range(2)]
        await asyncio.gather(*warm)
        t0 = time.monotonic()

        async def worker() -> None:
            while time.monotonic() < t0 + span:
                o = await send(client, mix.well_formed(False), args.request_timeout)
                (done_at if o.status == 200 and o.complete else others).append(o.finished_at)
                if o.status == 429 or o.status is None:  # refused or failed: back off
                    await asyncio.sleep(1.0)

        workers = [asyncio.create_task(worker()) for _ in range(n)]
        await asyncio.sleep(span)
        for w in workers:
            w.cancel()  # in-flight requests are dropped: the server sees disconnects
        await asyncio.gather(*workers, return_exceptions=True)
    w = span / 3
    windows = [sum(t0 + k * w <= t < t0 + (k + 1) * w for t in done_at) / w for k in range(3)]
    return {
        "concurrency": n,
        "duration_s": span,
        "windows_req_s": windows,
        "rate": statistics.median(windows),
        "completed": len(done_at),
        "not_completed": len(others),
    }


async def open_loop(
    url: str, args: argparse.Namespace, rate: float, sampler: RssSampler | None
) -> dict[str, Any]:
    """Poisson arrivals at ``rate`` for ``args.duration`` s; then every request is drained."""
    mix, arrivals = make_mix(args, args.seed), random.Random(args.seed + 2)
    # Enough connections for every arrival of a request timeout: the pool must not cap the
    # load below the server's own in-flight limit, or the 429 path is never reached.
    conns = args.max_connections or min(2048, max(32, math.ceil(rate * args.request_timeout)))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < conns + 256:
        want = conns + 256 if hard == resource.RLIM_INFINITY else min(hard, conns + 256)
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    outcomes: list[Outcome] = []
    tasks: set[asyncio.Task[Outcome]] = set()
    peak, sent = 0, 0

    def finished(task: asyncio.Task[Outcome], spec: RequestSpec) -> None:
        tasks.discard(task)
        outcomes.append(Outcome(spec, error="cancelled") if task.cancelled() else task.result())

    async with client_for(url, conns, args.request_timeout) as client:
        t0 = time.monotonic()
        sampling = sampler and asyncio.create_task(sampler.run(t0, args.sample_interval))
        every = max(10.0, args.duration / 10)
        next_t, next_report = arrivals.expovariate(rate), every
        while next_t < args.duration:
            await asyncio.sleep(max(0.0, t0 + next_t - time.monotonic()))
            spec = mix.next()
            task = asyncio.create_task(send(client, spec, args.request_timeout))
            task.add_done_callback(functools.partial(finished, spec=spec))
            tasks.add(task)
            sent, peak = sent + 1, max(peak, len(tasks))
            next_t += arrivals.expovariate(rate)
            if next_t >= next_report:
                c = tally(outcomes)["well_formed"]
                print(
                    f"  t={next_report:4.0f} s: sent {sent}, in flight {len(tasks)}, "
                    f"200 {c['2xx']}, 429 {c['429']}, not ok {c['not_answered_ok']}",
                    flush=True,
                )
                next_report += every
        await asyncio.sleep(max(0.0, t0 + args.duration - time.monotonic()))
        if sampling:
            sampling.cancel()
        if sampler:
            sampler.sample(time.monotonic() - t0)  # the end sample
        if tasks:  # every request has its own timeout; the margin only guards against a bug
            _, pending = await asyncio.wait(set(tasks), timeout=args.request_timeout + 10)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
    last = max((o.finished_at for o in outcomes), default=t0 + args.duration)
    return {
        "rate": rate,
        "duration_s": args.duration,
        "sent": sent,
        "connections": conns,
        "peak_in_flight": peak,
        "wall_s": last - t0,
        "outcomes": outcomes,
    }


# -- report -----------------------------------------------------------------------------------
ANSWER_ROWS = [  # (row of the answers table, key of soak_load.tally)
    ("2xx", "2xx"),
    ("429", "429"),
    ("  of which without Retry-After", "429_without_retry_after"),
    ("other 4xx", "other_4xx"),
    ("5xx", "5xx"),
    ("no HTTP answer (transport error, timeout)", "transport_errors"),
    ("200, error event in the stream", "stream_errors"),
    ("200, cut short", "incomplete_200"),
    ("200, client disconnected on purpose", "disconnected"),
    ("not answered as required", "not_answered_ok"),
]


def pct_ms(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) * 1000 if xs else float("nan")


def latency(outcomes: list[Outcome], wall: float) -> dict[str, float]:
    ok = [o for o in outcomes if o.spec.malformed is None and o.status == 200 and not o.error]
    ttft = [o.ttft for o in outcomes if o.status == 200 and o.ttft is not None]  # all streams
    whole = [o for o in ok if o.complete]
    tokens = sum(o.tokens for o in whole)
    return {
        "ttft_p50_ms": pct_ms(ttft, 50),
        "ttft_p99_ms": pct_ms(ttft, 99),
        "ttft_n": len(ttft),
        "e2e_p50_ms": pct_ms([o.e2e for o in whole], 50),
        "e2e_p99_ms": pct_ms([o.e2e for o in whole], 99),
        "e2e_n": len(whole),
        "admitted_tokens": tokens,
        "admitted_tok_s": tokens / wall,
        "admitted_req_s": len(whole) / wall,
    }


def verdict(res: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """The failed criteria (empty: PASS)."""
    wf, bad = res["counts"]["well_formed"], res["counts"]["malformed"]
    failed = []
    if wf["5xx"] + bad["5xx"]:
        failed.append(f"5xx ({wf['5xx'] + bad['5xx']})")
    if wf["not_answered_ok"]:
        failed.append(f"well-formed requests not answered 200 or 429 ({wf['not_answered_ok']})")
    if wf["429_without_retry_after"]:
        failed.append(f"429 without Retry-After ({wf['429_without_retry_after']})")
    grown = [
        f"{r['label']} "
        + ("gone or new" if r["growth_pct"] is None else f"{r['growth_pct']:+.1f} %")
        for r in res["memory"]
        if not r["ok"]
    ]
    if grown:
        failed.append(f"RSS growth >= {args.rss_growth_limit:g} % ({', '.join(grown)})")
    if bad["not_answered_ok"]:
        failed.append(f"malformed bodies not answered 4xx ({bad['not_answered_ok']})")
    if not res["server_alive"]:
        failed.append("the server exited during the run")
    return failed


def print_report(res: dict[str, Any]) -> None:
    """The readable tables: phases, answers, latency, memory."""
    sat, ol, lat = res["saturation"], res["open_loop"], res["latency"]
    if sat:
        win = " / ".join(f"{x:.2f}" for x in sat["windows_req_s"])
        print(
            f"\nsaturation: {sat['concurrency']} clients, {sat['duration_s']:.0f} s: "
            f"{win} req/s per window, median {sat['rate']:.2f} req/s"
        )
    print(
        f"open loop: {ol['rate']:.2f} req/s Poisson for {ol['duration_s']:.0f} s, sent "
        f"{ol['sent']}, peak in flight {ol['peak_in_flight']} (pool {ol['connections']})\n"
    )
    if ol["peak_in_flight"] > ol["connections"]:
        print("warning: requests waited for the client's pool; raise --max-connections\n")
    wf, bad = res["counts"]["well_formed"], res["counts"]["malformed"]
    print(f"| answers | well-formed ({wf['sent']}) | malformed ({bad['sent']}) |\n|---|---:|---:|")
    for name, key in ANSWER_ROWS:
        print(f"| {name} | {wf[key]} | {bad[key]} |")
    answers = [
        f"{kind} " + ", ".join(f"{status} x{n}" for status, n in by.items())
        for kind, by in res["malformed_answers"].items()
    ]
    print("malformed bodies, answers:", "; ".join(answers) or "none sent")
    if res["errors"]:
        print(
            "transport errors and timeouts:",
            ", ".join(f"{k} x{v}" for k, v in res["errors"].items()),
        )
    print("\n| admitted requests | p50 (ms) | p99 (ms) | n |\n|---|---:|---:|---:|")
    for name, key in (("TTFT (streams)", "ttft"), ("E2E (whole answers)", "e2e")):
        print(f"| {name} | {lat[key + '_p50_ms']:.0f} | {lat[key + '_p99_ms']:.0f} | "
              f"{lat[key + '_n']} |")  # fmt: skip
    print(
        f"admitted throughput: {lat['admitted_tok_s']:.1f} tok/s, {lat['admitted_req_s']:.2f} "
        f"req/s ({lat['admitted_tokens']} tokens in {ol['wall_s']:.0f} s)\n"
    )
    if res["memory"]:
        at = res["memory"][0]["warm_at_s"], res["memory"][0]["end_at_s"]
        print(f"| process | pid | RSS at {at[0]:.0f} s (MiB) | RSS at {at[1]:.0f} s (MiB) | "
              "growth |\n|---|---:|---:|---:|---:|")  # fmt: skip
        for r in res["memory"]:
            mib = ["-" if v is None else f"{v:.1f}" for v in (r["warm_mib"], r["end_mib"])]
            g = "-" if r["growth_pct"] is None else f"{r['growth_pct']:+.2f} %"
            print(f"| {r['label']} | {r['pid']} | {mib[0]} | {mib[1]} | {g} |")
    else:
        print("RSS not measured (with --url, give --pid of the coordinator)")


async def soak(args: argparse.Namespace, url: str, pid: int | None) -> dict[str, Any]:
    sat = None if args.rate else await saturation(url, args)
    if sat is not None and sat["rate"] <= 0:
        raise RuntimeError("no request completed in the saturation phase: give --rate or a longer "
                           f"--saturation-duration ({sat})")  # fmt: skip
    rate = args.rate or args.rate_factor * sat["rate"]  # type: ignore[index]
    print(f"open loop at {rate:.2f} req/s for {args.duration:.0f} s", flush=True)
    sampler = RssSampler(pid) if pid is not None else None
    ol = await open_loop(url, args, rate, sampler)
    outcomes = ol.pop("outcomes")
    errors: dict[str, int] = {}
    malformed: dict[str, dict[str, int]] = {}
    for o in outcomes:
        if o.error:
            errors[o.error] = errors.get(o.error, 0) + 1
        if o.spec.malformed is not None:
            by = malformed.setdefault(o.spec.malformed, {})
            by[str(o.status or o.error)] = by.get(str(o.status or o.error), 0) + 1
    warm_s = args.warmup_fraction * args.duration
    return {
        "saturation": sat,
        "open_loop": ol,
        "counts": tally(outcomes),
        "errors": errors,
        "malformed_answers": malformed,
        "latency": latency(outcomes, ol["wall_s"]),
        "warmup_s": warm_s,
        "memory": sampler.report(warm_s, args.rss_growth_limit) if sampler else [],
        "rss_samples": sampler.series() if sampler else [],
    }


def parse_args(argv: list[str]) -> argparse.Namespace:
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a = ap.add_argument
    a("--url", help="target this running server instead of starting one")
    a("--pid", type=int, help="with --url: the coordinator's pid, for the RSS figures")
    a("--serve-arg", action="append", default=[], help="flag for corefleet serve (repeatable)")
    a("--rate", type=float, help="open-loop req/s (skips the saturation phase)")
    a("--rate-factor", type=float, default=2.0, help="open-loop rate / saturation (default 2)")
    a("--duration", type=float, default=600.0, help="open-loop seconds (default 600)")
    a("--saturation-duration", type=float, default=30.0, help="closed-loop s (default 30)")
    a("--saturation-concurrency", type=int, default=64, help="closed-loop clients (default 64)")
    a("--max-tokens", type=int, nargs=2, default=[16, 64], help="range (default 16 64)")
    a("--stream-fraction", type=float, default=0.5, help="streamed requests (default 0.5)")
    a("--disconnect-fraction", type=float, default=0.10, help="disconnects (default 0.10)")
    a("--malformed-fraction", type=float, default=0.01, help="malformed bodies (default 0.01)")
    a("--huge-n", type=int, default=100_000, help="n of the huge-n body (default 100000)")
    a("--model", help="model name sent in bodies (default: none, the served model)")
    a("--request-timeout", type=float, default=120.0, help="per request, s (default 120)")
    a("--max-connections", type=int, default=0, help="pool size (default: 30 s of arrivals)")
    a("--sample-interval", type=float, default=5.0, help="RSS sampling period, s (default 5)")
    a("--warmup-fraction", type=float, default=0.2, help="RSS baseline point (default 0.2)")
    a("--rss-growth-limit", type=float, default=5.0, help="pass criterion, %% (default 5)")
    a("--ready-timeout", type=float, default=300.0, help="s to wait for /ready (default 300)")
    a("--stop-timeout", type=float, default=60.0, help="s from SIGTERM to SIGKILL (default 60)")
    a("--seed", type=int, default=0, help="workload seed (default 0)")
    a("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    args.serve_args = args.serve_arg + extra
    return args


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main() -> int:
    args = parse_args(sys.argv[1:])
    # Ctrl-C and SIGTERM raise KeyboardInterrupt wherever the loop is: asyncio.run's own SIGINT
    # handling only cancels the main task, and a cancel can be absorbed on the way out.
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    proc, url, pid, log = None, args.url, args.pid, None
    try:
        if url is None:
            proc, url, log = start_server(args.serve_args, args.ready_timeout)
            pid = proc.pid
        res = asyncio.run(soak(args, url, pid))
        res["server_alive"] = proc is None or proc.poll() is None
    except (RuntimeError, TimeoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        print(f"interrupted ({exc}): stopping serve", file=sys.stderr)
        return 130
    finally:
        exit_code = stop_server(proc, args.stop_timeout) if proc is not None else None
    res["server_exit_code"] = exit_code
    print_report(res)
    if proc is not None:
        print(f"serve exited with {exit_code} after SIGTERM (log: {log})")
    failed = verdict(res, args)
    res["verdict"] = {"pass": not failed, "failed": failed}
    if args.json:
        res["args"] = {k: v if isinstance(v, int | float | list) else str(v)
                       for k, v in vars(args).items()}  # fmt: skip
        args.json.write_text(json.dumps(res, indent=2, default=str))
    print("PASS" if not failed else "FAIL: " + "; ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
