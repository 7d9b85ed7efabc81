"""``/metrics`` of ``corefleet serve`` on SmolLM2: every ``vllm:`` metric vLLM's Grafana
dashboards read (examples/observability/prometheus_grafana/grafana.json and the
dashboards/grafana ones of vllm-project/vllm) is there, with vLLM's type and labels, and its
values add up to the requests sent."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from corefleet.engine.frontend.tokenizer import Tokenizer
from corefleet.engine.models.loader import resolve_model_path
from tests.serve_support import running_serve

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
FLAGS = ("--dtype", "float32", "--kv-cache-memory", str(256 << 20))
# Over two KV blocks of 16 tokens, so that sending it twice hits the prefix cache.
LONG_PROMPT = (
    "Paris is the capital and largest city of France. It is on the Seine river, in the north "
    "of the country, and it has been a major centre of finance, diplomacy, commerce, culture, "
    "fashion and gastronomy for centuries. The capital of France is"
)
# name -> type, for every metric the dashboards query (the names as scraped).
DASHBOARD = {
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:prompt_tokens": "counter",
    "vllm:prompt_tokens_cached": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:request_success": "counter",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_max_num_generation_tokens": "histogram",
    "vllm:request_params_n": "histogram",
    "vllm:request_params_max_tokens": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:num_preemptions": "counter",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:iteration_tokens_total": "histogram",
    "vllm:cache_config_info": "gauge",
}
FLEET_GAUGES = {
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
}


@dataclass
class Sent:
    """What the requests' answers say, choice by choice."""

    finish: dict[str, int] = field(default_factory=dict)
    prompt_tokens: int = 0  # summed over choices (each sample computes its prompt)
    completion_tokens: list[int] = field(default_factory=list)  # per choice
    n: list[int] = field(default_factory=list)  # per prompt
    longest: list[int] = field(default_factory=list)  # per prompt: its longest sample
    max_tokens: list[int] = field(default_factory=list)  # per choice

    def add(self, completion: openai.types.Completion, n: int, max_tokens: int) -> None:
        assert completion.usage is not None and len(completion.choices) == n
        self.prompt_tokens += completion.usage.prompt_tokens * n
        self.n.append(n)
        self.max_tokens += [max_tokens] * n
        lengths = []
        for choice in completion.choices:
            self.finish[choice.finish_reason] = self.finish.get(choice.finish_reason, 0) + 1
            # The usage sums the choices: a choice's own count is its logprobs' length.
            if n > 1:
                assert choice.logprobs is not None and choice.logprobs.tokens is not None
                lengths.append(len(choice.logprobs.tokens))
        if n == 1:
            lengths = [completion.usage.completion_tokens]
        assert sum(lengths) == completion.usage.completion_tokens
        self.completion_tokens += lengths
        self.longest.append(max(lengths))


_TOKENIZER: list[Tokenizer] = []


def tokenizer() -> Tokenizer:
    if not _TOKENIZER:
        _TOKENIZER.append(Tokenizer.from_model_path(resolve_model_path(None)))
    return _TOKENIZER[0]


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, Sent]]:
    with running_serve(*FLAGS) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", timeout=120, max_retries=0)
        sent = Sent()

        def complete(
            prompt: str,
            n: int = 1,
            max_tokens: int = 6,
            logprobs: int | None = None,
            **extra: object,
        ) -> str:
            completion = client.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=max_tokens,
                temperature=0.0,
                n=n,
                logprobs=logprobs,
                extra_body=extra or None,
            )
            sent.add(completion, n, max_tokens)
            return completion.choices[0].text

        greedy = complete(LONG_PROMPT)  # ends by length (6 tokens)
        complete(LONG_PROMPT)  # the same prompt: its first two blocks come from the cache
        first_token = tokenizer().encode(greedy, add_special_tokens=False)[0]
        complete(LONG_PROMPT, stop_token_ids=[first_token])  # the engine stops it: "stop"
        complete(LONG_PROMPT, max_tokens=20, stop=[greedy.strip()[:3]])  # a stop string
        complete("Once upon a time", n=2, max_tokens=5, logprobs=0)  # two samples, one prompt
        yield base, sent


def scrape(base: str) -> dict[str, tuple[str, list[Sample]]]:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    return {f.name: (f.type, f.samples) for f in text_string_to_metric_families(text)}


def value(samples: list[Sample], name: str, **labels: str) -> float:
    found = [s.value for s in samples if s.name == name and labels.items() <= s.labels.items()]
    assert found, f"no {name} sample with {labels}"
    return math.fsum(found)


def test_every_dashboard_metric_has_vllm_name_type_and_labels(served: tuple[str, Sent]) -> None:
    base, _ = served
    families = scrape(base)
    for name, kind in DASHBOARD.items():
        assert name in families, f"{name} is missing from /metrics"
        assert families[name][0] == kind, f"{name} is a {families[name][0]}, not a {kind}"
        samples = families[name][1]
        assert samples, f"{name} has no samples"
        for sample in samples:
            if name == "vllm:cache_config_info":
                assert sample.labels["engine"] == "0" and sample.value == 1.0
            elif name in FLEET_GAUGES:
                assert sample.labels == {"model_name": MODEL}
            else:
                assert sample.labels["model_name"] == MODEL, sample
                assert sample.labels["engine"] == "0", sample
    success = families["vllm:request_success"][1]
    reasons = {s.labels["finished_reason"] for s in success if s.name.endswith("_total")}
    assert reasons == {"stop", "length", "abort", "error"}  # every reason, 0 until counted
    (info,) = families["vllm:cache_config_info"][1]
    assert info.labels["block_size"] == "16" and info.labels["enable_prefix_caching"] == "True"
    assert int(info.labels["num_gpu_blocks"]) > 1


def test_request_metrics_add_up_to_the_requests_sent(served: tuple[str, Sent]) -> None:
    base, sent = served
    families = scrape(base)

    def total(name: str, sample: str, **labels: str) -> float:
        return value(families[name][1], sample, **labels)

    choices = len(sent.completion_tokens)
    assert sent.finish.get("stop", 0) >= 2 and sent.finish.get("length", 0) >= 2
    for reason in ("stop", "length"):
        counted = total(
            "vllm:request_success", "vllm:request_success_total", finished_reason=reason
        )
        assert counted == sent.finish[reason], reason
    assert total("vllm:prompt_tokens", "vllm:prompt_tokens_total") == sent.prompt_tokens
    generated = sum(sent.completion_tokens)
    assert total("vllm:generation_tokens", "vllm:generation_tokens_total") == generated
    # One observation per choice ...
    for name in (
        "vllm:e2e_request_latency_seconds",
        "vllm:time_to_first_token_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:request_prefill_time_seconds",
        "vllm:request_decode_time_seconds",
        "vllm:request_inference_time_seconds",
        "vllm:request_time_per_output_token_seconds",
        "vllm:request_prompt_tokens",
        "vllm:request_generation_tokens",
        "vllm:request_params_max_tokens",
    ):
        assert total(name, f"{name}_count") == choices, name
        assert total(name, f"{name}_sum") >= 0, name
    assert total("vllm:request_prompt_tokens", "vllm:request_prompt_tokens_sum") == (
        sent.prompt_tokens
    )
    assert total("vllm:request_generation_tokens", "vllm:request_generation_tokens_sum") == (
        generated
    )
    assert total("vllm:request_params_max_tokens", "vllm:request_params_max_tokens_sum") == sum(
        sent.max_tokens
    )
    # ... one per token after each choice's first (one token per step here) ...
    for name in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"):
        assert total(name, f"{name}_count") == generated - choices, name
    # ... and one per prompt.
    assert total("vllm:request_params_n", "vllm:request_params_n_count") == len(sent.n)
    assert total("vllm:request_params_n", "vllm:request_params_n_sum") == sum(sent.n)
    assert total("vllm:request_params_n", "vllm:request_params_n_bucket", le="1.0") == (
        sent.n.count(1)
    )
    name = "vllm:request_max_num_generation_tokens"
    assert total(name, f"{name}_count") == len(sent.n)
    assert total(name, f"{name}_sum") == sum(sent.longest)
    # The phases: inference is prefill then decode, and none is longer than the whole request.
    prefill = total("vllm:request_prefill_time_seconds", "vllm:request_prefill_time_seconds_sum")
    decode = total("vllm:request_decode_time_seconds", "vllm:request_decode_time_seconds_sum")
    inference = total(
        "vllm:request_inference_time_seconds", "vllm:request_inference_time_seconds_sum"
    )
    e2e = total("vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_sum")
    assert prefill > 0 and decode > 0
    assert inference == pytest.approx(prefill + decode, rel=1e-6)
    assert inference <= e2e
    # Buckets are cumulative and end with +Inf = count.
    name = "vllm:e2e_request_latency_seconds"
    buckets = [s for s in families[name][1] if s.name == f"{name}_bucket"]
    assert [s.value for s in buckets] == sorted(s.value for s in buckets)
    assert buckets[-1].labels["le"] == "+Inf" and buckets[-1].value == choices


def test_rank_counters_follow_the_engine_stats(served: tuple[str, Sent]) -> None:
    """The counters come from the rank's EngineStats, sent at least every 500 ms: poll until
    they cover every request sent."""
    base, sent = served
    # All steps together computed every prompt token the cache did not serve, and every
    # generated token but the last of each choice.
    decoded = sum(sent.completion_tokens) - len(sent.completion_tokens)
    deadline = time.monotonic() + 60
    while True:
        families = scrape(base)
        queries = value(families["vllm:prefix_cache_queries"][1], "vllm:prefix_cache_queries_total")
        hits = value(families["vllm:prefix_cache_hits"][1], "vllm:prefix_cache_hits_total")
        samples = families["vllm:iteration_tokens_total"][1]
        steps = value(samples, "vllm:iteration_tokens_total_count")
        tokens = value(samples, "vllm:iteration_tokens_total_sum")
        if queries >= sent.prompt_tokens and tokens >= sent.prompt_tokens - hits + decoded:
            break
        assert time.monotonic() < deadline, f"stats did not catch up: {queries=} {tokens=}"
        time.sleep(0.2)
    assert 32 <= hits <= queries  # the repeated long prompt's two full blocks, at least
    # What the requests' first outputs said the cache served: those hits (a request that was
    # looked up again, not admitted at once, counts once here).
    cached = value(families["vllm:prompt_tokens_cached"][1], "vllm:prompt_tokens_cached_total")
    assert 32 <= cached <= hits
    assert value(families["vllm:num_preemptions"][1], "vllm:num_preemptions_total") == 0
    assert steps >= 1 and tokens >= steps  # each step computed at least one token
    assert value(samples, "vllm:iteration_tokens_total_bucket", le="+Inf") == steps
    buckets = [s.value for s in samples if s.name == "vllm:iteration_tokens_total_bucket"]
    assert buckets == sorted(buckets)
