"""``/metrics``: vLLM's metric names, types, buckets and labels (so vLLM's Grafana dashboards and
alerts work unchanged), plus the fleet's own ``corefleet_*`` metrics.

vLLM labels its metrics ``model_name`` and ``engine`` (the data-parallel engine index); here
``engine`` is the rank that served the request (``""`` for a request no rank took). The
request-level metrics are fed by :class:`~corefleet.engine.openai.request_metrics.RequestStats`
as a generation's outputs arrive; the ranks' gauges and cumulative counters are read from
their latest ``EngineStats`` at scrape time (``metrics_fleet.py``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from corefleet.engine.coordinator.fleet_client import FleetClient
from corefleet.engine.messages import EngineCoreRequest
from corefleet.engine.openai.admission import InFlightLimiter
from corefleet.engine.openai.metrics_fleet import AdmissionCollector, FleetCollector
from corefleet.engine.openai.request_metrics import RequestStats

if TYPE_CHECKING:
    from corefleet.engine.openai.serving import Generation

LABELS = ("model_name", "engine")
# vLLM's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
N_BUCKETS = (1, 2, 5, 10, 20)
# The finish reasons vLLM counts in vllm:request_success (its FinishReason, lower case).
FINISH_REASONS = ("stop", "length", "abort", "error")
# The token-count histograms' buckets reach the context length; before any rank said its
# max_model_len (a request failed with no rank), this bound stands in.
FALLBACK_MAX_MODEL_LEN = 1 << 20

_Child = TypeVar("_Child", Counter, Histogram)


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's ``build_1_2_5_buckets``)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


class PerEngine(Generic[_Child]):
    """A ``model_name``/``engine`` labelled metric's children, one per engine, made on first
    use (ranks join at any time)."""

    def __init__(self, metric: _Child, model_name: str) -> None:
        self.metric: _Child = metric
        self.model_name = model_name
        self._children: dict[str, _Child] = {}

    def __call__(self, engine: str) -> _Child:
        child = self._children.get(engine)
        if child is None:
            child = self._children[engine] = self.metric.labels(self.model_name, engine)
        return child


class TokenHistograms:
    """The histograms of token counts, whose buckets follow the context length."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int) -> None:
        buckets = build_1_2_5_buckets(max_model_len)

        def histogram(name: str, doc: str) -> PerEngine[Histogram]:
            metric = Histogram(name, doc, LABELS, registry=registry, buckets=buckets)
            return PerEngine(metric, model_name)

        self.prompt = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.")
        self.generation = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed."
        )
        self.max_generation = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
        )
        self.max_tokens = histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter."
        )


class RenamedHistogram(Collector):
    """Another histogram's samples under another name (a deprecated alias), at scrape time."""

    def __init__(self, source: Histogram, name: str, doc: str) -> None:
        self.source, self.name, self.doc = source, name, doc
        self.source_name = source._name  # prometheus_client's own name, without a suffix

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            renamed = Metric(self.name, self.doc, family.type)
            for sample in family.samples:
                suffix = sample.name[len(self.source_name) :]
                renamed.add_sample(self.name + suffix, sample.labels, sample.value)
            yield renamed


class ServingMetrics:
    """The registry behind ``/metrics`` and the handles the request metrics record into."""

    def __init__(self, fleet: FleetClient, model_name: str) -> None:
        self.fleet, self.model_name = fleet, model_name
        self.registry = registry = CollectorRegistry()
        registry.register(FleetCollector(fleet, model_name))

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> PerEngine[Histogram]:
            metric = Histogram(name, doc, LABELS, registry=registry, buckets=buckets)
            return PerEngine(metric, model_name)

        def counter(name: str, doc: str) -> PerEngine[Counter]:
            return PerEngine(Counter(name, doc, LABELS, registry=registry), model_name)

        self.ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        )
        # vLLM's name before 0.11, which its example dashboard still reads: the same values,
        # copied from the ITL histogram at scrape time rather than observed twice per token.
        registry.register(
            RenamedHistogram(
                self.itl.metric,
                "vllm:time_per_output_token_seconds",
                "Histogram of time per output token in seconds. "
                "DEPRECATED: Use vllm:inter_token_latency_seconds instead.",
            )
        )
        self.request_tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS,
        )

        def latency(name: str, doc: str) -> PerEngine[Histogram]:
            return histogram(name, doc, REQUEST_LATENCY_BUCKETS)

        self.e2e = latency(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds."
        )
        self.queue_time = latency(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
        )
        self.inference_time = latency(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
        )
        self.prefill_time = latency(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
        )
        self.decode_time = latency(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
        )
        self.params_n = histogram(
            "vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.prompt_tokens_cached = counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        )
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self._success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*LABELS, "finished_reason"],
            registry=registry,
        )
        self._success_engines: set[str] = set()
        self._tokens: TokenHistograms | None = None

    def request_success(self, engine: str, finished_reason: str) -> Counter:
        if engine not in self._success_engines:  # vLLM shows every reason, at 0 until counted
            self._success_engines.add(engine)
            for reason in FINISH_REASONS:
                self._success.labels(self.model_name, engine, reason)
        return self._success.labels(self.model_name, engine, finished_reason)

    def tokens(self) -> TokenHistograms:
        """The token-count histograms, made once a rank said its context length."""
        if self._tokens is None:
            max_model_len = self._max_model_len()
            if max_model_len is None:
                max_model_len = FALLBACK_MAX_MODEL_LEN
            self._tokens = TokenHistograms(self.registry, self.model_name, max_model_len)
        return self._tokens

    def _max_model_len(self) -> int | None:
        for member in self.fleet.membership.members.values():
            if member.info is not None:
                return member.info.max_model_len
        return None

    def request_stats(self, generation: Generation) -> RequestStats:
        """A new observer of ``generation``'s outputs, for its request-level metrics."""
        params = generation.params
        return RequestStats(self, generation.engine_requests, params.n, generation.parent_of)

    def pooling_stats(self, requests: Sequence[EngineCoreRequest]) -> RequestStats:
        """A new observer of pooling requests' outputs (one vector each)."""
        return RequestStats(self, requests, pooling=True)

    def watch_admission(self, limiter: InFlightLimiter) -> None:
        """Export ``limiter``'s completions in flight and its refusals."""
        self.registry.register(AdmissionCollector(limiter))

    def render(self) -> bytes:
        if self._tokens is None and self._max_model_len() is not None:
            self.tokens()  # shown from the first scrape after a rank is ready, as vLLM's
        return generate_latest(self.registry)
