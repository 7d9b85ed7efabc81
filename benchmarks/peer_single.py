"""Single-stream decode of both peer servers running side by side, one request each in turn.

``peer_llamacpp.py`` measures one server, stops it and starts the other: minutes apart. This
machine's speed drifts by a quarter or more within minutes, which moves a single stream's rate
as much as the difference being measured. Here both servers are up at once (each idle while the
other serves), and one 128-token request goes to each in turn, the order alternating pair by
pair, so both see the same phase of the machine. The figure to trust is the median of the
per-pair ratios.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import peer_servers as ps

# The benchmark's streaming client: (url, prompts, streams, max_tokens) -> (results, wall time)
Load = Callable[[str, list[list[int]], int, int], Coroutine[Any, Any, tuple[list[Any], float]]]


def interleaved_single(
    servers: Sequence[tuple[str, list[str], str]],
    pairs: int,
    tokens: int,
    next_prompt: Callable[[], list[int]],
    load: Load,
    ready_timeout: float,
) -> str:
    """Run ``pairs`` rounds of one request per server; return a markdown table of the rates."""
    started = [ps.start(name, argv, ready, ready_timeout) for name, argv, ready in servers]
    rates: dict[str, list[float]] = {s.name: [] for s in started}
    ratios: list[float] = []
    failed = 0
    try:
        for server in started:  # warm-up
            asyncio.run(load(server.url, [next_prompt()], 1, 16))
        for pair in range(pairs):
            prompt = next_prompt()
            order = started if pair % 2 == 0 else started[::-1]
            rate: dict[str, float] = {}
            for server in order:
                results, _ = asyncio.run(load(server.url, [prompt], 1, tokens))
                r = results[0]
                if r.error or len(r.times) < 2:
                    print(f"  {server.name}: failed request: {r.error}", file=sys.stderr)
                    failed += 1
                    continue
                rate[server.name] = (r.tokens - 1) / (r.times[-1] - r.times[0])
                rates[server.name].append(rate[server.name])
            if len(rate) == 2:
                first, second = (rate[s.name] for s in started)
                ratios.append(first / second)
    finally:
        for server in started:
            ps.stop(server)
    names = [s.name for s in started]
    lines = [
        f"single stream, both servers up, {pairs} alternating pairs of {tokens}-token requests; "
        f"ratio: {names[0]} / {names[1]}, median of the per-pair ratios",
        "",
        f"| | {names[0]} | {names[1]} | ratio (min–max) |",
        "|---|---|---|---|",
        f"| single-stream decode tok/s | {statistics.median(rates[names[0]]):.1f} | "
        f"{statistics.median(rates[names[1]]):.1f} | {statistics.median(ratios):.2f} "
        f"({min(ratios):.2f}–{max(ratios):.2f}) |",
        f"| failed requests | {failed} | | |",
    ]
    return "\n".join(lines)
