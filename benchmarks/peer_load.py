"""The load ``peer_llamacpp.py`` puts on one running server, and what it measures.

Every request is a streamed ``/v1/completions`` with a prompt of random token ids, greedy and
``ignore_eos``, so both servers compute exactly the tokens asked for; a request that returns
another count fails. :func:`measure` runs, in order: a warm-up, single-stream decode, one long
prompt at a time (time to first token), then each concurrency level; it reads the server's
memory once ready and after the load, and the CPU time the rest of the machine took meanwhile.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

import httpx
import numpy as np
import peer_servers as ps
import psutil

Figures = dict[str, float]


@dataclass(frozen=True)
class LoadPlan:
    """What is sent to each server (the same for both)."""

    input_len: int = 64  # prompt tokens of the decode requests
    single_requests: int = 3  # one at a time; the median rate is the figure
    single_tokens: int = 128
    ttft_prompt: int = 2000  # prompt tokens of the prefill requests (0: none)
    ttft_requests: int = 3  # one at a time; the median TTFT is the figure
    streams: tuple[int, ...] = (8, 32)
    stream_tokens: int = 64
    rounds: int = 2  # requests per stream, one after the other


@dataclass
class Stream:
    """One streamed request: the times (from its start) of the chunks that carried text."""

    tokens: int = 0  # completion tokens (usage; the text chunks if the server sent no usage)
    times: list[float] = field(default_factory=list)
    error: str = ""

    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:], strict=False)]


class Prompts:
    """Prompts of random token ids, seeded: the same sequence for both servers. Each prompt is
    new from its first token, so no prefix cache (either server's) serves any of it."""

    def __init__(self, vocab: int, length: int, seed: int) -> None:
        self.rng, self.vocab, self.length = random.Random(seed), vocab, length

    def next(self, length: int | None = None) -> list[int]:
        count = self.length if length is None else length
        return [self.rng.randrange(100, self.vocab - 100) for _ in range(count)]


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
        base_url=url, timeout=900, limits=limits, trust_env=False
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


def measure(server: ps.Server, plan: LoadPlan, prompts: Prompts) -> Figures:
    """Everything measured on one running server."""
    pid, url = server.proc.pid, server.url
    figs: Figures = {"ready_s": server.ready_s, "failed": 0}
    figs["pss_load"], figs["rss_load"], figs["procs"] = ps.memory_mib(pid)
    machine_before, ours_before = sum(psutil.cpu_times()[:3]), cpu_seconds(pid)
    client_before, started = time.process_time(), time.perf_counter()

    def run(
        streams: int, count: int, tokens: int, length: int | None = None
    ) -> tuple[list[Stream], float]:
        batch = [prompts.next(length) for _ in range(count)]
        results, wall = asyncio.run(load(url, batch, streams, tokens))
        for r in results:
            if r.error:
                print(f"  {server.name}: failed request: {r.error}", file=sys.stderr)
        figs["failed"] += sum(1 for r in results if r.error)
        return [r for r in results if not r.error], wall

    run(2, 2, 16)  # warm-up
    rates, ttfts = [], []
    for _ in range(plan.single_requests):
        for r in run(1, 1, plan.single_tokens)[0]:
            if len(r.times) > 1:
                rates.append((r.tokens - 1) / (r.times[-1] - r.times[0]))
            ttfts.append(r.times[0])
    figs["single_tok_s"] = statistics.median(rates) if rates else float("nan")
    figs["single_ttft"] = pct(ttfts, 50)
    if plan.ttft_prompt:
        # A few output tokens, not one: a token may stream with empty text (half a UTF-8
        # character), and TTFT is the first chunk that carries text.
        long = [
            r.times[0] for _ in range(plan.ttft_requests) for r in run(1, 1, 4, plan.ttft_prompt)[0]
        ]
        figs["prefill_ttft"] = pct(long, 50)
        figs["prefill_tok_s"] = plan.ttft_prompt / (figs["prefill_ttft"] / 1000)
    for n in plan.streams:
        done, wall = run(n, n * plan.rounds, plan.stream_tokens)
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
