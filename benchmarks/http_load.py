"""A small closed-loop HTTP/1.1 load generator: keep-alive connections, one request at a time each.

No ``wrk`` here, and an HTTP client library (httpx, aiohttp) costs more CPU per request than the
servers this measures, so the load is raw sockets: each connection writes a prepared request and
reads the response (``Content-Length`` or chunked), counting the server-sent events of a streamed
one. Load runs in ``--processes`` worker processes (``python benchmarks/http_load.py --worker``),
each an asyncio loop holding its share of the connections; a worker prints its counts as JSON.

    python benchmarks/http_load.py --url http://127.0.0.1:8000/v1/completions \
        --body '{"model": "m", "prompt": "hi", "max_tokens": 4}' --connections 64 --duration 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit


@dataclass
class Counts:
    """What one worker (or all of them, merged) saw inside the measured window."""

    requests: int = 0
    failed: int = 0  # a status other than 200, or a connection that broke
    events: int = 0  # `data:` lines of streamed responses, `[DONE]` excluded
    latencies_ms: list[float] = field(default_factory=list)

    def merge(self, other: Counts) -> None:
        self.requests += other.requests
        self.failed += other.failed
        self.events += other.events
        self.latencies_ms += other.latencies_ms


@dataclass(frozen=True)
class LoadResult:
    """A whole load run: rates over the measured window and latency percentiles."""

    requests_per_s: float
    events_per_s: float
    failed: int
    p50_ms: float
    p99_ms: float
    client_cpu_s: float


def request_bytes(url: str, body: bytes) -> bytes:
    parts = urlsplit(url)
    head = (
        f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def read_response(reader: asyncio.StreamReader) -> tuple[int, int]:
    """One response: its status and the number of SSE ``data:`` events it carried."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = bytearray()
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            body += await reader.readexactly(size + 2)
            if size == 0:
                break
    else:
        body = bytearray(await reader.readexactly(int(headers.get("content-length", "0"))))
    events = body.count(b"data: ") - body.count(b"data: [DONE]")
    return status, events


async def _connection(host: str, port: int, payload: bytes, start: float, stop: float) -> Counts:
    counts = Counts()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        while (sent := time.monotonic()) < stop:
            writer.write(payload)
            try:
                status, events = await read_response(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                counts.failed += sent >= start
                return counts
            done = time.monotonic()
            if sent >= start:  # only requests sent inside the window count
                counts.requests += 1
                counts.failed += status != 200
                counts.events += events
                counts.latencies_ms.append((done - sent) * 1000)
    finally:
        writer.close()
    return counts


async def _worker(url: str, body: bytes, connections: int, warmup: float, duration: float) -> None:
    parts = urlsplit(url)
    start = time.monotonic() + warmup
    payload = request_bytes(url, body)
    tasks = [
        _connection(
            parts.hostname or "127.0.0.1", parts.port or 80, payload, start, start + duration
        )
        for _ in range(connections)
    ]
    total = Counts()
    for counts in await asyncio.gather(*tasks):
        total.merge(counts)
    print(json.dumps(asdict(total)))


def run_load(
    url: str,
    body: dict[str, object],
    connections: int,
    duration: float,
    processes: int = 2,
    warmup: float = 2.0,
) -> LoadResult:
    """``connections`` keep-alive connections in ``processes`` workers for ``duration`` seconds
    (after ``warmup``), each sending ``body`` again as soon as its last response ended."""
    shares = [connections // processes + (i < connections % processes) for i in range(processes)]
    data = json.dumps(body)
    argv = [sys.executable, os.path.abspath(__file__), "--worker", "--url", url, "--body", data]
    argv += ["--warmup", str(warmup), "--duration", str(duration)]
    before = os.times()
    workers = [
        subprocess.Popen([*argv, "--connections", str(n)], stdout=subprocess.PIPE, text=True)
        for n in shares
        if n > 0
    ]
    total = Counts()
    for worker in workers:
        out, _ = worker.communicate(timeout=warmup + duration + 120)
        if worker.returncode != 0:
            raise RuntimeError(f"load worker exited with {worker.returncode}")
        total.merge(Counts(**json.loads(out)))
    after = os.times()
    latencies = sorted(total.latencies_ms) or [float("nan")]
    return LoadResult(
        requests_per_s=total.requests / duration,
        events_per_s=total.events / duration,
        failed=total.failed,
        p50_ms=statistics.median(latencies),
        p99_ms=latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
        client_cpu_s=(after.children_user + after.children_system)
        - (before.children_user + before.children_system),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--body", required=True, help="the JSON body every request sends")
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        asyncio.run(
            _worker(args.url, args.body.encode(), args.connections, args.warmup, args.duration)
        )
        return
    result = run_load(
        args.url, json.loads(args.body), args.connections, args.duration, args.processes
    )
    print(json.dumps(asdict(result), indent=2))


if __name__ == "__main__":
    main()
