"""``corefleet serve`` with two local ranks, driven by the official ``openai`` client."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from corefleet.engine import LLM, SamplingParams
from tests.fixtures_models import write_tiny_llama
from tests.serve_support import running_serve

pytestmark = pytest.mark.slow

API_KEY = "test-key"
ENGINE_FLAGS = ("--dtype", "float32", "--kv-cache-memory", str(8 << 20), "--block-size", "4")
PROMPTS = ["Hello world", "The quick brown fox", "def add(a, b):"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture(scope="module")
def server(model: Path) -> Iterator[str]:
    flags = ("--model", str(model), "--data-parallel-size", "2", "--api-key", API_KEY)
    with running_serve(*flags, *ENGINE_FLAGS) as base:
        yield base


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(model: Path) -> list[str]:
    llm = LLM(
        str(model), multiprocess=False, dtype="float32", kv_cache_memory=8 << 20, block_size=4
    )
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)
    llm.shutdown()
    return [o.outputs[0].text for o in outs]


def test_greedy_completions_equal_the_offline_llm(
    client: openai.OpenAI, offline: list[str]
) -> None:
    for prompt, expected in zip(PROMPTS, offline, strict=True):
        response = client.completions.create(
            model="m", prompt=prompt, max_tokens=12, temperature=0.0
        )
        assert response.choices[0].text == expected
        assert response.choices[0].finish_reason == "length"
        assert response.usage is not None and response.usage.completion_tokens == 12


def test_streaming_equals_the_whole_answer(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Say something."}]
    whole = client.chat.completions.create(
        model="m",
        messages=messages,
        max_tokens=16,
        temperature=0.0,  # type: ignore[arg-type]
    )
    stream = client.chat.completions.create(
        model="m",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=16,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16


def test_n_samples_and_stop_strings(client: openai.OpenAI, offline: list[str]) -> None:
    response = client.completions.create(
        model="m", prompt=PROMPTS[0], max_tokens=12, temperature=1.0, n=3, seed=7
    )
    assert sorted(c.index for c in response.choices) == [0, 1, 2]
    stop = offline[0][3:5]
    cut = client.completions.create(
        model="m", prompt=PROMPTS[0], max_tokens=12, temperature=0.0, stop=[stop]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == offline[0][: offline[0].index(stop)]


def test_bad_requests_are_400s_naming_the_field(client: openai.OpenAI, server: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="m", prompt="x", max_tokens=0)
    assert err.value.body["param"] == "max_tokens"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m", messages=[], max_tokens=4)
    assert err.value.body["param"] == "messages"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="m", prompt="x", temperature=-1)
    with pytest.raises(openai.BadRequestError, match=r"max_model_len|context"):
        client.completions.create(model="m", prompt=[5] * 400, max_tokens=4)
    with pytest.raises(openai.NotFoundError, match="'m'"):
        client.completions.create(model="other", prompt="x")
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    raw = httpx.post(f"{server}/v1/completions", content=b"{not json", headers=headers)
    assert raw.status_code == 400 and "error" in raw.json()
    assert httpx.get(f"{server}/v1/models").status_code == 401  # no key
    # The engines are unharmed.
    assert client.completions.create(model="m", prompt="x", max_tokens=2).choices[0].text


def test_fields_that_would_change_the_answer_are_400s_and_unknown_ones_pass(
    client: openai.OpenAI,
) -> None:
    messages: Any = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError, match="KV transfer") as err:
        client.chat.completions.create(
            model="m",
            messages=messages,
            max_tokens=2,
            extra_body={"kv_transfer_params": {"do_remote_prefill": True}},
        )
    assert err.value.body["param"] == "kv_transfer_params"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m", messages=messages, tool_choice="required")
    assert err.value.body["param"] == "tool_choice"  # type: ignore[index]
    tools: Any = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    # Tools default to tool_choice "auto", which this server (no --enable-auto-tool-choice)
    # cannot read: a 400 saying how to enable it, as vLLM answers.
    with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice") as err:
        client.chat.completions.create(model="m", messages=messages, tools=tools)
    assert err.value.body["code"] == "invalid_tool_choice"  # type: ignore[index]
    answered = client.completions.create(
        model="m",
        prompt="x",
        max_tokens=2,
        extra_body={"guided_json": None, "tool_choice": "none", "x_proxy_tag": "a"},
    )
    assert answered.choices[0].finish_reason == "length"


def _engines_until(server: str, done: Any, what: str) -> list[dict[str, Any]]:
    """``/admin/engines`` polled until ``done(engines)``; every wait has a timeout."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    deadline = time.monotonic() + 60
    while True:
        engines: list[dict[str, Any]] = httpx.get(
            f"{server}/admin/engines", headers=headers, timeout=30
        ).json()
        if done(engines):
            return engines
        assert time.monotonic() < deadline, f"{what}: {engines}"
        time.sleep(0.1)


def test_models_metrics_and_admin(client: openai.OpenAI, server: str) -> None:
    assert [m.id for m in client.models.list()] == ["m"]
    # /ready needs one rank; under load the second may still be loading.
    engines = _engines_until(
        server,
        lambda es: len(es) == 2 and all(e["state"] == "ready" for e in es),
        "both ranks never ready",
    )
    assert sorted(e["rank"] for e in engines) == [0, 1]
    for i in range(6):
        client.completions.create(model="m", prompt=f"load {i}", max_tokens=4)
    _engines_until(
        server,
        lambda es: all(e["stats"] and e["stats"]["steps"] > 0 for e in es),
        "requests were not spread",
    )
    metrics = httpx.get(f"{server}/metrics").text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:generation_tokens_total",
        'corefleet_ranks{state="ready"} 2.0',
    ):
        assert name in metrics


def test_a_client_that_disconnects_mid_stream_frees_its_request(server: str) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": "m", "prompt": "long", "max_tokens": 240, "stream": True}
    with httpx.stream(
        "POST", f"{server}/v1/completions", json=body, headers=headers, timeout=30
    ) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
    # The connection is closed: both ranks soon report nothing running or waiting.
    deadline = time.monotonic() + 10
    while True:
        engines = httpx.get(f"{server}/admin/engines", headers=headers).json()
        # A rank still starting has no stats yet, and nothing running.
        busy = [
            e for e in engines if e["stats"] and (e["stats"]["running"] or e["stats"]["waiting"])
        ]
        if not busy:
            break
        assert time.monotonic() < deadline, f"still running after disconnect: {busy}"
        time.sleep(0.2)


def test_logprobs_come_back_in_both_formats(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        temperature=0.0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == chat.usage.completion_tokens  # type: ignore[union-attr]
    for token in content:
        assert len(token.top_logprobs) == 2
        assert token.top_logprobs[0].logprob >= token.top_logprobs[1].logprob
        assert token.logprob == token.top_logprobs[0].logprob  # greedy takes the best
    completion = client.completions.create(
        model="m", prompt="Hello", max_tokens=4, temperature=0.0, logprobs=3
    )
    lp = completion.choices[0].logprobs
    assert lp is not None and len(lp.token_logprobs or []) == 4
    # Keyed by decoded text: alternatives that decode alike (e.g. partial UTF-8) share a key.
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs or [])
    assert all(
        max(top.values()) == value
        for top, value in zip(lp.top_logprobs or [], lp.token_logprobs or [], strict=True)
    )
    assert lp.text_offset == sorted(lp.text_offset or [])


def test_a_streamed_answer_never_shows_its_stop_string(
    client: openai.OpenAI, offline: list[str]
) -> None:
    text = offline[1]
    for stop in (text[4:7], text[2:4]):  # stop strings that span several tokens
        stream = client.completions.create(
            model="m", prompt=PROMPTS[1], max_tokens=12, temperature=0.0, stop=[stop], stream=True
        )
        chunks = list(stream)
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
        assert streamed == text[: text.index(stop)]
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
