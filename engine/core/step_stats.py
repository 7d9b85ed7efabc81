"""The tokens each engine step computed, as a cumulative histogram for vLLM's
``vllm:iteration_tokens_total`` (the coordinator exports it per rank from ``EngineStats``)."""

from __future__ import annotations

import bisect

# vLLM's buckets for vllm:iteration_tokens_total; a last, +Inf bucket follows them.
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class StepTokenHistogram:
    """Steps by tokens scheduled: ``counts[i]`` steps had at most ``bounds[i]`` tokens and
    more than ``bounds[i - 1]`` (not cumulative; the last entry is the +Inf bucket)."""

    def __init__(self, bounds: tuple[int, ...] = ITERATION_TOKEN_BUCKETS) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0  # tokens over all steps

    def observe(self, num_tokens: int) -> None:
        if num_tokens <= 0:  # a step that only reported finished requests computed nothing
            return
        self.counts[bisect.bisect_left(self.bounds, num_tokens)] += 1
        self.total += num_tokens
