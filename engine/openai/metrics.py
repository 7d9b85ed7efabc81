"""``/metrics``: vLLM's metric names (so existing dashboards work) plus the fleet's own.

Gauges are read from the ranks' latest EngineStats at scrape time; latency histograms and
token counters are fed by the HTTP handlers as requests stream.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from corefleet.engine.coordinator.fleet_client import FleetClient
from corefleet.engine.coordinator.membership import RankState
from corefleet.engine.openai.admission import InFlightLimiter

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class _FleetCollector(Collector):
    def __init__(self, fleet: FleetClient, model_name: str) -> None:
        self.fleet, self.model_name = fleet, model_name

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        live = [m for m in self.fleet.membership.members.values() if m.state is not RankState.DEAD]
        stats = [m.stats for m in live if m.stats is not None]
        labels = ["model_name"]
        for name, doc, value in (
            (
                "vllm:num_requests_running",
                "Requests running on the ranks",
                sum(s.num_running_reqs for s in stats),
            ),
            (
                "vllm:num_requests_waiting",
                "Requests waiting on the ranks",
                sum(s.num_waiting_reqs for s in stats),
            ),
            (
                "vllm:kv_cache_usage_perc",
                "KV-cache usage, mean over ranks (1 = full)",
                sum(s.kv_cache_usage for s in stats) / len(stats) if stats else 0.0,
            ),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=labels)
            gauge.add_metric([self.model_name], value)
            yield gauge
        ranks = GaugeMetricFamily("corefleet_ranks", "Ranks per state", labels=["state"])
        for state, count in self.fleet.membership.counts().items():
            ranks.add_metric([state], count)
        yield ranks
        counters = self.fleet.counters
        for name, doc, value in (
            ("corefleet_migrations", "Requests moved off a dead rank", counters.migrations),
            (
                "corefleet_refusals_rerouted",
                "Requests refused by a draining rank and sent elsewhere",
                counters.refusals_rerouted,
            ),
            (
                "corefleet_requests_failed",
                "Requests the fleet could not serve",
                counters.requests_failed,
            ),
        ):
            family = CounterMetricFamily(name, doc)
            family.add_metric([], value)
            yield family


class _AdmissionCollector(Collector):
    def __init__(self, limiter: InFlightLimiter) -> None:
        self.limiter = limiter

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        in_flight = GaugeMetricFamily(
            "corefleet_api_completions_in_flight",
            "Completions admitted by the API and not finished (a request counts n × prompts)",
        )
        in_flight.add_metric([], self.limiter.in_flight)
        yield in_flight
        refused = CounterMetricFamily(
            "corefleet_api_requests_refused", "Requests refused with 429 (over a limit in flight)"
        )
        refused.add_metric([], self.limiter.refused)
        yield refused


class ServingMetrics:
    """The registry behind ``/metrics`` and the handles the handlers record into."""

    def __init__(self, fleet: FleetClient, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_FleetCollector(fleet, model_name))
        labels = ["model_name"]

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, labels, registry=self.registry, buckets=_LATENCY_BUCKETS)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token").labels(
            model_name
        )
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between tokens").labels(
            model_name
        )
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Request latency").labels(
            model_name
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens processed", labels, registry=self.registry
        ).labels(model_name)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Tokens generated", labels, registry=self.registry
        ).labels(model_name)

    def watch_admission(self, limiter: InFlightLimiter) -> None:
        """Export ``limiter``'s completions in flight and its refusals."""
        self.registry.register(_AdmissionCollector(limiter))

    def render(self) -> bytes:
        return generate_latest(self.registry)
