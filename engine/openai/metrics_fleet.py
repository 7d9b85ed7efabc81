"""The ``/metrics`` read from the ranks at scrape time: their latest ``EngineStats`` (gauges,
cumulative counters, the step-size histogram) and ``ReadyResponse`` (cache settings), and the
admission limiter's figures.

The load gauges (``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc``) are one series for the whole fleet, without vLLM's ``engine``
label: the autoscaling examples read them as the fleet's queue (``examples/hpa.yaml``). The
counters and the histogram are per rank (``engine`` = the rank), as vLLM's are per engine; a
rank that restarts starts its counters again from 0, which Prometheus' ``rate`` allows for.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector

from corefleet.engine.coordinator.fleet_client import FleetClient
from corefleet.engine.coordinator.membership import RankMember, RankState
from corefleet.engine.core.step_stats import ITERATION_TOKEN_BUCKETS
from corefleet.engine.openai.admission import InFlightLimiter

_Family = GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily
_ENGINE_LABELS = ["model_name", "engine"]


class FleetCollector(Collector):
    def __init__(self, fleet: FleetClient, model_name: str) -> None:
        self.fleet, self.model_name = fleet, model_name

    def collect(self) -> Iterator[_Family]:
        live = [m for m in self.fleet.membership.members.values() if m.state is not RankState.DEAD]
        stats = [m.stats for m in live if m.stats is not None]
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
            gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
            gauge.add_metric([self.model_name], value)
            yield gauge
        yield from self._rank_counters(live)
        yield self._iteration_tokens(live)
        yield self._cache_config(live)
        ranks = GaugeMetricFamily("corefleet_ranks", "Ranks per state", labels=["state"])
        for state, count in self.fleet.membership.counts().items():
            ranks.add_metric([state], count)
        yield ranks
        counters = self.fleet.counters
        for name, doc, total in (
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
            family.add_metric([], total)
            yield family

    def _rank_counters(self, live: list[RankMember]) -> Iterator[CounterMetricFamily]:
        for name, doc, field in (
            (
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                "prefix_cache_queries",
            ),
            (
                "vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                "prefix_cache_hits",
            ),
            (
                "vllm:num_preemptions",
                "Cumulative number of preemption from the engine.",
                "num_preemptions",
            ),
        ):
            family = CounterMetricFamily(name, doc, labels=_ENGINE_LABELS)
            for member in live:
                if member.stats is not None:
                    value = getattr(member.stats, field)
                    family.add_metric([self.model_name, str(member.rank)], value)
            yield family

    def _iteration_tokens(self, live: list[RankMember]) -> HistogramMetricFamily:
        family = HistogramMetricFamily(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            labels=_ENGINE_LABELS,
        )
        bounds = [str(float(b)) for b in ITERATION_TOKEN_BUCKETS] + ["+Inf"]
        for member in live:
            stats = member.stats
            # An older rank sends no counts; a rank with other bounds cannot be shown.
            if stats is None or len(stats.iteration_token_counts) != len(bounds):
                continue
            cumulative, buckets = 0, []
            for bound, count in zip(bounds, stats.iteration_token_counts, strict=True):
                cumulative += count
                buckets.append((bound, float(cumulative)))
            family.add_metric(
                [self.model_name, str(member.rank)], buckets, float(stats.iteration_tokens_sum)
            )
        return family

    def _cache_config(self, live: list[RankMember]) -> GaugeMetricFamily:
        """vLLM's info metric: a gauge at 1 whose labels are the cache settings."""
        family = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=[
                "block_size",
                "cache_dtype",
                "enable_prefix_caching",
                "num_gpu_blocks",
                "engine",
            ],
        )
        for member in live:
            info = member.info
            if info is None:
                continue
            labels = [
                str(info.block_size),
                info.cache_dtype,
                str(info.enable_prefix_caching),  # "True" / "False", as vLLM writes it
                str(info.num_gpu_blocks),
                str(member.rank),
            ]
            family.add_metric(labels, 1.0)
        return family


class AdmissionCollector(Collector):
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
