"""The engine's lifecycle events (vLLM's QUEUED / SCHEDULED / PREEMPTED) and the request-level
metrics the coordinator makes of them (``openai/request_metrics.py``), with hand-made clocks."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from corefleet.engine.coordinator.fleet_client import FleetCounters, StampedOutput
from corefleet.engine.coordinator.membership import Membership
from corefleet.engine.core.step_stats import StepTokenHistogram
from corefleet.engine.messages import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    SamplingParams,
)
from corefleet.engine.openai.metrics import ServingMetrics, build_1_2_5_buckets
from tests.unit.scheduler_helpers import make_request, make_scheduler, outputs_by_id, step

QUEUED, SCHEDULED, PREEMPTED = (
    EngineCoreEventType.QUEUED,
    EngineCoreEventType.SCHEDULED,
    EngineCoreEventType.PREEMPTED,
)
MODEL = "m"


# ---- the engine side ------------------------------------------------------------------------


def test_first_output_carries_queued_and_scheduled_events() -> None:
    sched = make_scheduler()
    make_request(sched, "a", 5, max_tokens=3)
    _, eo = step(sched)
    events = outputs_by_id(eo)["a"].events
    assert events is not None and [e.type for e in events] == [QUEUED, SCHEDULED]
    assert events[0].timestamp <= events[1].timestamp <= eo[0].timestamp
    _, eo = step(sched)  # a plain decode: the fast path, nothing to report
    assert outputs_by_id(eo)["a"].events is None


def test_a_preempted_request_reports_it_with_its_next_token() -> None:
    sched = make_scheduler(num_blocks=6, block_size=4, caching=False)  # 5 usable blocks
    make_request(sched, "a", 8, max_tokens=2)
    make_request(sched, "b", 8)
    step(sched)  # both prompts
    _, eo = step(sched)  # b is preempted: it has no output this step
    assert "b" not in outputs_by_id(eo)
    _, eo = step(sched)  # b resumes
    events = outputs_by_id(eo)["b"].events
    assert events is not None and [e.type for e in events] == [PREEMPTED, SCHEDULED]
    _, eo = step(sched)
    assert outputs_by_id(eo)["b"].events is None  # back on the fast path


def test_step_token_histogram_buckets() -> None:
    histogram = StepTokenHistogram((1, 8))
    for tokens in (0, 1, 2, 8, 9, 100):
        histogram.observe(tokens)
    assert histogram.counts == [1, 2, 2]  # <=1, (1, 8], +Inf; a step of 0 tokens is no step
    assert histogram.total == 120


def test_1_2_5_buckets_as_vllm() -> None:
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(2048)[-1] == 2000


# ---- the coordinator side -------------------------------------------------------------------


@dataclass
class _Fleet:
    """What ServingMetrics reads of a FleetClient: a membership (no rank) and its counters."""

    membership: Membership = field(default_factory=lambda: Membership("tcp://a", "tcp://b"))
    counters: FleetCounters = field(default_factory=FleetCounters)


@dataclass
class _Generation:
    """What RequestStats reads of a Generation: its engine requests, their prompts and n."""

    engine_requests: list[EngineCoreRequest]
    params: SamplingParams

    def parent_of(self, engine_id: str) -> str:
        return engine_id.rsplit("-", 1)[0]


def _generation(n: int = 1, prompt_len: int = 4, max_tokens: int | None = 8) -> _Generation:
    params = SamplingParams(n=n, max_tokens=max_tokens)
    requests = [EngineCoreRequest(f"r-0-{i}", list(range(prompt_len)), params) for i in range(n)]
    return _Generation(requests, params)


def _out(
    request_id: str,
    tokens: int,
    rank: int,
    at: float,
    *events: tuple[EngineCoreEventType, float],
    cached: int = 0,
) -> StampedOutput:
    output = EngineCoreOutput(
        request_id,
        [7] * tokens,
        num_cached_tokens=cached,
        events=[EngineCoreEvent(t, ts) for t, ts in events] or None,
    )
    return StampedOutput(output, rank, at)


def _sample(metrics: ServingMetrics, name: str, **labels: str) -> float:
    found = metrics.registry.get_sample_value(name, {"model_name": MODEL, **labels})
    return 0.0 if found is None else found


@pytest.fixture
def metrics() -> ServingMetrics:
    return ServingMetrics(_Fleet(), MODEL)  # type: ignore[arg-type]


def test_phases_on_the_rank_clock(metrics: ServingMetrics) -> None:
    stats = metrics.request_stats(_generation())  # type: ignore[arg-type]
    stats.observe(_out("r-0-0", 1, 3, 11.0, (QUEUED, 10.0), (SCHEDULED, 10.5), cached=2), None)
    stats.observe(_out("r-0-0", 1, 3, 11.25, (PREEMPTED, 11.1), (SCHEDULED, 11.2)), None)
    stats.observe(_out("r-0-0", 1, 3, 11.5), "length")
    engine = {"engine": "3"}
    for name, expected in (
        ("vllm:request_queue_time_seconds", 0.5),
        ("vllm:request_prefill_time_seconds", 0.5),
        ("vllm:request_decode_time_seconds", 0.5),  # a preemption stays inside the phase
        ("vllm:request_inference_time_seconds", 1.0),
        ("vllm:request_time_per_output_token_seconds", 0.25),
        ("vllm:inter_token_latency_seconds", 0.5),
        ("vllm:time_per_output_token_seconds", 0.5),
    ):
        assert _sample(metrics, f"{name}_sum", **engine) == pytest.approx(expected), name
    assert _sample(metrics, "vllm:inter_token_latency_seconds_count", **engine) == 2
    assert _sample(metrics, "vllm:request_success_total", finished_reason="length", **engine) == 1
    assert _sample(metrics, "vllm:request_success_total", finished_reason="stop", **engine) == 0
    assert _sample(metrics, "vllm:prompt_tokens_total", **engine) == 4
    assert _sample(metrics, "vllm:prompt_tokens_cached_total", **engine) == 2
    assert _sample(metrics, "vllm:generation_tokens_total", **engine) == 3
    assert _sample(metrics, "vllm:time_to_first_token_seconds_count", **engine) == 1
    assert _sample(metrics, "vllm:request_generation_tokens_sum", **engine) == 3
    assert _sample(metrics, "vllm:request_params_max_tokens_sum", **engine) == 8
    assert _sample(metrics, "vllm:request_params_n_sum", **engine) == 1
    assert _sample(metrics, "vllm:e2e_request_latency_seconds_count", **engine) == 1


def test_a_migrated_request_is_timed_on_the_rank_that_finished_it(
    metrics: ServingMetrics,
) -> None:
    stats = metrics.request_stats(_generation())  # type: ignore[arg-type]
    stats.observe(_out("r-0-0", 1, 0, 11.0, (QUEUED, 10.0), (SCHEDULED, 10.5)), None)
    stats.observe(_out("r-0-0", 1, 0, 11.5), None)
    # Rank 0 died; rank 1, on a clock of its own, takes over (its cache held the prompt).
    stats.observe(_out("r-0-0", 1, 1, 502.0, (QUEUED, 500.0), (SCHEDULED, 501.0), cached=4), None)
    stats.observe(_out("r-0-0", 1, 1, 502.5), "stop")
    engine = {"engine": "1"}
    assert _sample(metrics, "vllm:request_queue_time_seconds_sum", **engine) == 1.0
    assert _sample(metrics, "vllm:request_prefill_time_seconds_sum", **engine) == 1.0
    assert _sample(metrics, "vllm:request_decode_time_seconds_sum", **engine) == 0.5
    # Inter-token latencies: 0.5 on rank 0 and 0.5 on rank 1, none across the two clocks.
    assert _sample(metrics, "vllm:inter_token_latency_seconds_count", engine="0") == 1
    assert _sample(metrics, "vllm:inter_token_latency_seconds_count", **engine) == 1
    assert _sample(metrics, "vllm:time_to_first_token_seconds_count", engine="0") == 1
    assert _sample(metrics, "vllm:time_to_first_token_seconds_count", **engine) == 0
    assert _sample(metrics, "vllm:prompt_tokens_total", engine="0") == 4  # counted once
    assert _sample(metrics, "vllm:prompt_tokens_cached_total", **engine) == 0
    assert _sample(metrics, "vllm:request_generation_tokens_sum", **engine) == 4
    assert _sample(metrics, "vllm:request_success_total", finished_reason="stop", **engine) == 1


def test_samples_of_one_prompt_make_one_params_n_observation(metrics: ServingMetrics) -> None:
    stats = metrics.request_stats(_generation(n=2))  # type: ignore[arg-type]
    stats.observe(_out("r-0-0", 1, 0, 1.0, (QUEUED, 0.0), (SCHEDULED, 0.0)), None)
    stats.observe(_out("r-0-1", 1, 0, 1.0, (QUEUED, 0.0), (SCHEDULED, 0.0)), None)
    stats.observe(_out("r-0-0", 2, 0, 2.0), "stop")  # a stop string: the coordinator's finish
    assert _sample(metrics, "vllm:request_params_n_count", engine="0") == 0  # one sample runs
    stats.observe(_out("r-0-1", 4, 0, 2.0), "length")
    assert _sample(metrics, "vllm:request_params_n_count", engine="0") == 1
    assert _sample(metrics, "vllm:request_params_n_sum", engine="0") == 2
    assert _sample(metrics, "vllm:request_max_num_generation_tokens_sum", engine="0") == 5
    assert _sample(metrics, "vllm:request_success_total", finished_reason="stop", engine="0") == 1
    assert _sample(metrics, "vllm:prompt_tokens_total", engine="0") == 8  # each sample's prompt


def test_a_request_the_fleet_failed_counts_as_an_error(metrics: ServingMetrics) -> None:
    stats = metrics.request_stats(_generation())  # type: ignore[arg-type]
    stats.observe(_out("r-0-0", 0, -1, 0.0), "error")  # no rank took it
    assert _sample(metrics, "vllm:request_success_total", finished_reason="error", engine="") == 1
    # It never ran: no phase to time, and the token histograms use the fallback buckets.
    assert _sample(metrics, "vllm:request_queue_time_seconds_count", engine="") == 0
    assert _sample(metrics, "vllm:request_generation_tokens_count", engine="") == 1
    assert b"vllm:request_success_total" in metrics.render()


def test_a_pooling_request_counts_its_prompt_and_phases_without_tokens(
    metrics: ServingMetrics,
) -> None:
    request = EngineCoreRequest("e-0", [1, 2, 3], SamplingParams(max_tokens=1))
    stats = metrics.pooling_stats([request])
    vector = EngineCoreOutput(
        "e-0",
        [],
        finish_reason=FinishReason.STOP,
        num_cached_tokens=1,
        pooling_output=b"\0\0\0\0",
        events=[EngineCoreEvent(QUEUED, 1.0), EngineCoreEvent(SCHEDULED, 1.5)],
    )
    stats.observe(StampedOutput(vector, 0, 2.5), "stop")
    engine = {"engine": "0"}
    assert _sample(metrics, "vllm:request_success_total", finished_reason="stop", **engine) == 1
    assert _sample(metrics, "vllm:prompt_tokens_total", **engine) == 3
    assert _sample(metrics, "vllm:prompt_tokens_cached_total", **engine) == 1
    assert _sample(metrics, "vllm:generation_tokens_total", **engine) == 0
    assert _sample(metrics, "vllm:request_queue_time_seconds_sum", **engine) == 0.5
    assert _sample(metrics, "vllm:request_prefill_time_seconds_sum", **engine) == 1.0
    assert _sample(metrics, "vllm:request_decode_time_seconds_sum", **engine) == 0.0
    assert _sample(metrics, "vllm:time_to_first_token_seconds_count", **engine) == 0
    # No sampling: neither n nor max_tokens is a parameter of it.
    assert _sample(metrics, "vllm:request_params_n_count", **engine) == 0
    assert _sample(metrics, "vllm:request_params_max_tokens_count", **engine) == 0
