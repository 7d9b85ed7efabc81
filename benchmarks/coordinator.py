"""The coordinator's own speed: requests/s and SSE tokens/s against its HTTP stack's bound.

Every request of a fleet passes through a coordinator process, so its cost per request and per
streamed token bounds the whole fleet. The ranks here do no model work (the null executor:
scheduler, KV manager, busy loop and sockets as they are, a fixed token per step), so what is
measured is the coordinator: HTTP parse, validation, tokenization, routing, ZMQ, outputs,
detokenization, the response or its SSE chunks.

Per run, alternating, each on its own free port:

- **trivial endpoints**: a FastAPI app that parses the JSON body and returns a fixed
  completion, the issue's yardstick, on two stacks: ``h11`` (uvicorn's pure-Python protocol, the
  coordinator's before it had its own, and the stack the issue measured) and ``httptools``
  (the coordinator's protocol class with its limits; FastAPI's routes go through its ASGI
  path). The second is the most a FastAPI endpoint gets from uvicorn;
- **coordinator, short completions**: ``corefleet serve --data-parallel-size 2`` with the null
  executor, ``max_tokens: 4``, not streamed (the trivial endpoint's load, same connections);
- **coordinator, SSE**: streamed completions of ``--sse-tokens`` tokens; the figure is data
  events (one token each) per second across all streams;
- with ``--api-server-counts 1,2``: the same two loads through ``serve --api-server-count N``
  for each N (N coordinator processes on one port, every rank joined to each), CPU summed over
  the API processes;
- with ``--baseline-engine DIR``: the coordinator of another checkout (``DIR`` is its
  ``engine/``, e.g. from ``git worktree add``), under the same loads in every run.

The load is ``benchmarks/http_load.py`` (raw keep-alive sockets, ``--load-processes`` worker
processes), the same for every server. The coordinator's CPU (its process alone, ranks apart) is
read from ``/proc`` around each load, as cores and as CPU time per request / per token; the
ranks' CPU per request too (they share the machine's cores with the coordinator).

    python benchmarks/coordinator.py --runs 3
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

from fastapi import FastAPI, Request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from http_load import LoadResult, run_load

NULL_EXECUTOR = "corefleet.engine.worker.null_executor:NullExecutor"
MODEL_NAME = "bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_trivial(port: int, stack: str) -> None:
    """A trivial endpoint (run in its own process: ``--trivial-server PORT --stack STACK``)."""
    from corefleet.engine.entrypoints.http_server import uvicorn_config
    from corefleet.engine.openai.limits import RequestLimits

    app = FastAPI()
    fixed = {
        "id": "cmpl-0",
        "object": "text_completion",
        "created": 0,
        "model": MODEL_NAME,
        "choices": [{"index": 0, "text": " a b c d", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6},
    }

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict[str, Any]:
        body = json.loads(await request.body())
        return {**fixed, "model": body.get("model", MODEL_NAME)}

    @app.get("/ready")
    async def ready() -> dict[str, bool]:
        return {"ready": True}

    import uvicorn

    config = uvicorn_config(app, "127.0.0.1", port, RequestLimits(), 5.0)
    if stack == "h11":
        config.http = "h11"
    uvicorn.Server(config).run()


def start(
    argv: list[str], port: int, timeout: float = 180.0, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env=env,
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{argv[:4]} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2):
                return proc
        except OSError:
            time.sleep(0.25)
    stop(proc)
    raise TimeoutError(f"{argv[:4]}: /ready not 200 after {timeout:.0f} s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def cpu_seconds(pid: int, with_api: bool = True) -> float:
    """CPU seconds of ``pid``, plus its API-process children (``--api-server-count``)."""
    pids = [pid, *api_children(pid)] if with_api else [pid]
    total = 0
    for one in pids:
        with open(f"/proc/{one}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def api_children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        children = [int(c) for c in f.read().split()]
    found = []
    for child in children:
        with open(f"/proc/{child}/cmdline", "rb") as f:
            if b"entrypoints.api_servers" in f.read():
                found.append(child)
    return found


def rank_pids(pid: int) -> list[int]:
    """The engine-rank processes ``serve`` started (its children that are not API processes)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        children = [int(c) for c in f.read().split()]
    return [c for c in children if c not in api_children(pid)]


def measured(pid: int, load: Any) -> tuple[LoadResult, float]:
    """Run ``load()`` and return its result and the CPU seconds ``pid`` used meanwhile."""
    before = cpu_seconds(pid)
    result = load()
    return result, cpu_seconds(pid) - before


def one_run(args: argparse.Namespace) -> dict[str, float]:
    row: dict[str, float] = {}
    short = {"model": MODEL_NAME, "prompt": "Hello there", "max_tokens": 4}
    for stack in ("h11", "httptools"):
        port = free_port()
        argv = [sys.executable, os.path.abspath(__file__), "--trivial-server", str(port)]
        trivial = start([*argv, "--stack", stack], port)
        try:
            url = f"http://127.0.0.1:{port}/v1/completions"
            load = functools.partial(
                run_load, url, short, args.connections, args.duration, args.load_processes
            )
            result, cpu = measured(trivial.pid, load)
            row[f"trivial {stack} req/s"] = result.requests_per_s
            row[f"trivial {stack} cores"] = cpu / args.duration
            row[f"trivial {stack} failed"] = result.failed
        finally:
            stop(trivial)
    for count in args.api_server_counts:
        row |= coordinator_figures(args, count, short, row)
    if args.baseline_engine:
        row |= coordinator_figures(args, 1, short, row, baseline_env(args.baseline_engine))
    return row


def baseline_env(engine_dir: str) -> dict[str, str]:
    """An environment whose ``corefleet.engine`` is ``engine_dir`` (another checkout's
    ``engine/``), the kernels staying this one's: a folder on ``PYTHONPATH`` that links both
    comes before the editable install."""
    shim = os.path.join(tempfile.gettempdir(), f"corefleet-baseline-{os.getpid()}")
    package = os.path.join(shim, "corefleet")
    os.makedirs(package, exist_ok=True)
    kernels = os.path.dirname(importlib.util.find_spec("corefleet.kernels").origin or "")
    for name, target in (("engine", os.path.abspath(engine_dir)), ("kernels", kernels)):
        link = os.path.join(package, name)
        if not os.path.islink(link):
            os.symlink(target, link)
    return {**os.environ, "PYTHONPATH": shim}


def coordinator_figures(
    args: argparse.Namespace,
    count: int,
    short: dict[str, Any],
    trivial: dict[str, float],
    env: dict[str, str] | None = None,
) -> dict[str, float]:
    """Short completions and SSE through ``serve --api-server-count count`` (with ``env``:
    the baseline checkout's coordinator)."""
    name = "coordinator" if count == 1 else f"{count} coordinators"
    if env is not None:
        name = "baseline coordinator"
    row: dict[str, float] = {}
    port = free_port()
    argv = [sys.executable, "-m", "corefleet.engine.cli", "serve", "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--served-model-name", MODEL_NAME]
    argv += ["--api-server-count", str(count)]
    argv += ["--data-parallel-size", str(args.ranks), "--distributed-executor-backend"]
    argv += [NULL_EXECUTOR, *args.corefleet_args.split()]
    server = start(argv, port, env=env)
    try:
        if count > 1:  # every API process must have a rank before the load starts
            time.sleep(5.0)
        url = f"http://127.0.0.1:{port}/v1/completions"
        ranks = rank_pids(server.pid)
        ranks_before = sum(cpu_seconds(pid, with_api=False) for pid in ranks)
        result, cpu = measured(
            server.pid,
            lambda: run_load(url, short, args.connections, args.duration, args.load_processes),
        )
        ranks_cpu = sum(cpu_seconds(pid, with_api=False) for pid in ranks) - ranks_before
        requests = max(1, result.requests_per_s * args.duration)
        row[f"{name} req/s"] = result.requests_per_s
        row[f"{name} p50 ms"] = result.p50_ms
        row[f"{name} cores"] = cpu / args.duration
        row[f"{name} CPU ms/request"] = cpu * 1000 / requests
        row[f"{name} ranks CPU ms/request"] = ranks_cpu * 1000 / requests
        row[f"{name} failed"] = result.failed
        for stack in ("h11", "httptools"):
            row[f"{name} ratio to {stack}"] = (
                result.requests_per_s / trivial[f"trivial {stack} req/s"]
            )
        # skip_special_tokens false: the null executor's token is a special one, and each
        # must show as text to make its own chunk.
        sse = {**short, "max_tokens": args.sse_tokens, "stream": True}
        sse |= {"ignore_eos": True, "skip_special_tokens": False}
        result, cpu = measured(
            server.pid,
            lambda: run_load(url, sse, args.sse_streams, args.duration, args.load_processes),
        )
        row[f"{name} SSE tokens/s"] = result.events_per_s
        row[f"{name} SSE cores"] = cpu / args.duration
        row[f"{name} SSE CPU us/token"] = cpu * 1e6 / max(1, result.events_per_s * args.duration)
        row[f"{name} SSE failed"] = result.failed
    finally:
        stop(server)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--connections", type=int, default=64, help="for short completions")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per load")
    parser.add_argument("--load-processes", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=2, help="null-executor ranks (DP)")
    parser.add_argument("--sse-streams", type=int, default=32)
    parser.add_argument("--sse-tokens", type=int, default=256)
    parser.add_argument("--corefleet-args", default="", help="extra `corefleet serve` flags")
    parser.add_argument(
        "--api-server-counts",
        type=lambda text: [int(n) for n in text.split(",")],
        default=[1],
        help="measure `serve --api-server-count N` for each N (e.g. 1,2)",
    )
    parser.add_argument(
        "--baseline-engine",
        help="another checkout's engine/ folder (e.g. from `git worktree add`): its "
        "coordinator is measured too, in every run",
    )
    parser.add_argument("--json", help="write every run's figures here")
    parser.add_argument("--trivial-server", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--stack", choices=["h11", "httptools"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trivial_server:
        serve_trivial(args.trivial_server, args.stack)
        return
    rows = []
    for i in range(args.runs):
        rows.append(one_run(args))
        print(f"run {i + 1}: " + ", ".join(f"{k} {v:.2f}" for k, v in rows[-1].items()), flush=True)
    print(f"\nmedian of {len(rows)} run(s) (runs in brackets)\n\n| | value |\n|---|---|")
    for key in rows[0]:
        values = [r[key] for r in rows]
        runs = " / ".join(f"{v:.2f}" for v in values)
        print(f"| {key} | {statistics.median(values):.2f} ({runs}) |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
