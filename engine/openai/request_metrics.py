"""vLLM's request-level metrics from one generation's outputs (vLLM's ``IterationStats`` and
``RequestStateStats``, vllm/v1/metrics/stats.py).

Each engine request (a choice: one sample of one prompt) is followed from its outputs:

- on the coordinator's clock, from when the request was handed to the fleet: time to first
  token and end-to-end latency;
- on the serving rank's clock (``time.monotonic()`` there; the ``QUEUED``/``SCHEDULED`` events
  its outputs carry and the time of each output's step): inter-token latency, and at the finish
  the queue (queued -> first scheduled), prefill (first scheduled -> first token), decode (first
  -> last token) and inference (first scheduled -> last token) times. A preemption stays inside
  these intervals, as in vLLM. A request moved off a dead rank starts these clocks again on the
  rank that takes it (two processes' clocks cannot be compared), so its phases are those on
  the rank that finished it.

A request's finish is the engine's, or the coordinator's for a stop string; the per-prompt
figures (``n`` and the longest of its samples) are recorded when its last sample finishes.
A request whose client went away before its end is not counted. A pooling request (an
embedding) counts as vLLM counts it: its prompt, its phases (its vector is its "first token"),
its finish; no generated tokens and no sampling parameters.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from corefleet.engine.coordinator.fleet_client import StampedOutput
from corefleet.engine.messages import EngineCoreEventType, EngineCoreRequest

if TYPE_CHECKING:
    from corefleet.engine.openai.metrics import ServingMetrics

_QUEUED = EngineCoreEventType.QUEUED
_SCHEDULED = EngineCoreEventType.SCHEDULED


@dataclass
class _Sample:
    """One engine request's progress. Timestamps ending in ``_ts`` are on ``rank``'s clock."""

    parent: str
    num_prompt_tokens: int
    max_tokens: int | None
    rank: int = -1
    num_generation_tokens: int = 0
    queued_ts: float = 0.0
    scheduled_ts: float = 0.0  # first scheduled on this rank: preemptions do not move it
    first_token_ts: float = 0.0
    last_token_ts: float = 0.0


@dataclass
class _Prompt:
    """vLLM's parent request: the samples of one prompt still running, and the longest yet."""

    unfinished: int
    max_generation_tokens: int = 0


class RequestStats:
    """Observes the outputs of one user request's engine requests (a generation's samples,
    ``parent_of`` naming each one's prompt, or pooling requests) and records them."""

    def __init__(
        self,
        metrics: ServingMetrics,
        requests: Sequence[EngineCoreRequest],
        n: int = 1,
        parent_of: Callable[[str], str] = str,
        pooling: bool = False,
    ) -> None:
        self.metrics = metrics
        self.arrival = time.monotonic()
        self.n, self.pooling = n, pooling
        self.samples: dict[str, _Sample] = {}
        self.prompts: dict[str, _Prompt] = {}
        for request in requests:
            parent = parent_of(request.request_id)
            max_tokens = None if pooling else request.sampling_params.max_tokens
            self.samples[request.request_id] = _Sample(
                parent, len(request.prompt_token_ids), max_tokens
            )
            prompt = self.prompts.setdefault(parent, _Prompt(0))
            prompt.unfinished += 1

    def observe(self, stamped: StampedOutput, finish_reason: str | None) -> None:
        output, rank, engine_time = stamped
        sample = self.samples.get(output.request_id)
        if sample is None:
            return
        if rank >= 0 and rank != sample.rank:
            # Another rank (the first, or one that took the request over): another clock.
            sample.rank = rank
            sample.queued_ts = sample.scheduled_ts = 0.0
            sample.first_token_ts = sample.last_token_ts = 0.0
        for event in output.events or ():
            if event.type == _QUEUED:
                sample.queued_ts = event.timestamp
            elif event.type == _SCHEDULED and not sample.scheduled_ts:
                sample.scheduled_ts = event.timestamp
        engine = str(sample.rank) if sample.rank >= 0 else ""
        num_new = len(output.new_token_ids)
        if num_new and rank >= 0:
            self._tokens(sample, engine, num_new, engine_time, output.num_cached_tokens)
        elif self.pooling and output.pooling_output is not None and rank >= 0:
            # The vector ends the prefill: count the prompt, and time it as a first token.
            self.metrics.prompt_tokens(engine).inc(sample.num_prompt_tokens)
            self.metrics.prompt_tokens_cached(engine).inc(output.num_cached_tokens)
            sample.first_token_ts = sample.last_token_ts = engine_time
        if finish_reason is not None:
            self._finish(sample, engine, finish_reason)

    def _tokens(
        self, sample: _Sample, engine: str, num_new: int, engine_time: float, cached: int
    ) -> None:
        metrics = self.metrics
        if sample.num_generation_tokens == 0:  # its prompt is computed: vLLM counts it now
            metrics.prompt_tokens(engine).inc(sample.num_prompt_tokens)
            metrics.prompt_tokens_cached(engine).inc(cached)  # the first output says it
            metrics.ttft(engine).observe(time.monotonic() - self.arrival)
        elif sample.last_token_ts:  # not the first output on this rank
            latency = engine_time - sample.last_token_ts
            metrics.itl(engine).observe(latency)  # also vllm:time_per_output_token_seconds
        if not sample.first_token_ts:
            sample.first_token_ts = engine_time
        sample.last_token_ts = engine_time
        sample.num_generation_tokens += num_new
        metrics.generation_tokens(engine).inc(num_new)

    def _finish(self, sample: _Sample, engine: str, finish_reason: str) -> None:
        metrics = self.metrics
        metrics.request_success(engine, finish_reason).inc()
        metrics.e2e(engine).observe(time.monotonic() - self.arrival)
        if sample.scheduled_ts and sample.first_token_ts:  # it ran, and made a token, here
            if sample.queued_ts:
                metrics.queue_time(engine).observe(sample.scheduled_ts - sample.queued_ts)
            metrics.prefill_time(engine).observe(sample.first_token_ts - sample.scheduled_ts)
            decode = sample.last_token_ts - sample.first_token_ts
            metrics.decode_time(engine).observe(decode)
            metrics.inference_time(engine).observe(sample.last_token_ts - sample.scheduled_ts)
            tokens = sample.num_generation_tokens
            metrics.request_tpot(engine).observe(decode / (tokens - 1) if tokens > 1 else 0.0)
        histograms = metrics.tokens()
        histograms.prompt(engine).observe(sample.num_prompt_tokens)
        histograms.generation(engine).observe(sample.num_generation_tokens)
        if self.pooling:
            return
        if sample.max_tokens is not None:
            histograms.max_tokens(engine).observe(sample.max_tokens)
        prompt = self.prompts[sample.parent]
        prompt.unfinished -= 1
        prompt.max_generation_tokens = max(
            prompt.max_generation_tokens, sample.num_generation_tokens
        )
        if prompt.unfinished == 0:
            metrics.params_n(engine).observe(self.n)
            histograms.max_generation(engine).observe(prompt.max_generation_tokens)
