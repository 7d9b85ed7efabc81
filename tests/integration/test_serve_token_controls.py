"""Token-level controls through ``corefleet serve`` on SmolLM2 with the official client
(``logit_bias``, ``allowed_token_ids``, ``bad_words``, ``logprob_token_ids``), and the same
fields in the offline ``LLM`` API."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from corefleet.engine import LLM, SamplingParams
from corefleet.engine.frontend.tokenizer import Tokenizer
from corefleet.engine.models.default_model import default_model_path
from tests.serve_support import running_serve

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
FLAGS = ("--dtype", "float32", "--kv-cache-memory", str(256 << 20))


@pytest.fixture(scope="module")
def ids() -> dict[str, int]:
    """Single-token words of SmolLM2's vocabulary, by text."""
    tok = Tokenizer.from_model_path(default_model_path())
    words = (" banana", "A", "B", "C", " Paris", "Paris", " London", "cat", "dog")
    found = {w: tok.encode(w, add_special_tokens=False) for w in words}
    assert all(len(v) == 1 for v in found.values()), found
    return {w: v[0] for w, v in found.items()}


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    with running_serve(*FLAGS) as url:
        yield url


@pytest.fixture(scope="module")
def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="x", timeout=120, max_retries=0)


EXTRA = ("allowed_token_ids", "bad_words", "logprob_token_ids", "guided_choice")


def complete(client: openai.OpenAI, **fields: Any) -> Any:
    extra = {k: fields.pop(k) for k in EXTRA if k in fields}
    body = {"temperature": 0.0, **fields}
    return client.completions.create(model=MODEL, prompt=PROMPT, extra_body=extra, **body)


def chat(client: openai.OpenAI, **fields: Any) -> Any:
    extra = {k: fields.pop(k) for k in EXTRA if k in fields}
    body = {"temperature": 0.0, "messages": QUESTION, **fields}
    return client.chat.completions.create(model=MODEL, extra_body=extra, **body)


def test_logit_bias_forces_and_bans_tokens(client: openai.OpenAI, ids: dict[str, int]) -> None:
    banana = {str(ids[" banana"]): 100}
    text = complete(client, max_tokens=3, logit_bias=banana).choices[0].text
    assert text == " banana banana banana"
    answer = chat(client, max_tokens=2, logit_bias=banana).choices[0].message.content
    assert answer == " banana banana"
    # SmolLM2 answers " Paris": a bias of -100 takes that token away.
    assert complete(client, max_tokens=1).choices[0].text == " Paris"
    banned = complete(client, max_tokens=1, logit_bias={str(ids[" Paris"]): -100})
    assert banned.choices[0].text != " Paris"


def test_allowed_token_ids_restrict_seeded_sampling(
    client: openai.OpenAI, ids: dict[str, int]
) -> None:
    allowed = [ids["A"], ids["B"], ids["C"]]
    first = complete(client, max_tokens=8, temperature=1.0, seed=5, allowed_token_ids=allowed)
    # EOS is not allowed either: the answer runs to max_tokens.
    assert re.fullmatch("[ABC]{8}", first.choices[0].text)
    assert first.choices[0].finish_reason == "length"
    again = complete(client, max_tokens=8, temperature=1.0, seed=5, allowed_token_ids=allowed)
    assert again.choices[0].text == first.choices[0].text
    reply = chat(client, max_tokens=6, temperature=1.0, seed=1, allowed_token_ids=allowed)
    assert re.fullmatch("[ABC]{6}", reply.choices[0].message.content)


def test_bad_words_are_not_generated(client: openai.OpenAI) -> None:
    assert "Paris" in complete(client, max_tokens=12).choices[0].text
    text = complete(client, max_tokens=12, bad_words=["Paris"]).choices[0].text
    assert "Paris" not in text and text.strip()
    answer = chat(client, max_tokens=16, bad_words=["Paris"]).choices[0].message.content
    assert "Paris" not in answer


def test_logprob_token_ids_report_the_named_tokens(
    client: openai.OpenAI, ids: dict[str, int]
) -> None:
    named = [ids[" Paris"], ids["Paris"], ids[" London"]]
    reply = chat(client, max_tokens=2, logprobs=True, logprob_token_ids=named)
    content = reply.choices[0].logprobs.content
    assert content is not None and len(content) == 2
    for token in content:
        alternatives = {t.token: t.logprob for t in token.top_logprobs}
        assert {" Paris", "Paris", " London"} <= set(alternatives)
        assert alternatives[token.token] == token.logprob  # the sampled token is listed too
        assert all(v <= 0 for v in alternatives.values())
    completion = complete(client, max_tokens=1, logprobs=0, logprob_token_ids=named)
    (top,) = completion.choices[0].logprobs.top_logprobs
    assert set(top) == {" Paris", "Paris", " London"}  # " Paris", the answer, once
    assert top[" Paris"] > top[" London"] > top["Paris"]


def test_controls_compose_with_structured_outputs(
    client: openai.OpenAI, ids: dict[str, int]
) -> None:
    for word in ("cat", "dog"):
        reply = chat(
            client, max_tokens=4, guided_choice=["cat", "dog"], logit_bias={str(ids[word]): 100}
        )
        assert reply.choices[0].message.content == word


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logit_bias": {"49152": 1}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(5000)}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [49152]}, "allowed_token_ids"),
        ({"allowed_token_ids": [1] * 100_000}, "allowed_token_ids"),
        ({"bad_words": [""]}, "bad_words"),
        ({"bad_words": ["x"] * 10_000}, "bad_words"),
        ({"logprob_token_ids": [1]}, "logprob_token_ids"),
        ({"logprobs": 1, "logprob_token_ids": list(range(1000))}, "logprob_token_ids"),
    ],
)
def test_absurd_values_are_a_400_and_the_server_lives_on(
    base: str, fields: dict[str, Any], param: str
) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, **fields}
    answer = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param
    ok = httpx.post(f"{base}/v1/completions", json={**body, **dict.fromkeys(fields)}, timeout=120)
    assert ok.status_code == 200, ok.text


def test_the_offline_llm_takes_the_same_fields(ids: dict[str, int]) -> None:
    llm = LLM(multiprocess=False, dtype="float32", kv_cache_memory=256 << 20)
    try:
        params = [
            SamplingParams(max_tokens=3, temperature=0.0, logit_bias={ids[" banana"]: 100.0}),
            SamplingParams(
                max_tokens=8, temperature=1.0, seed=3, allowed_token_ids=[ids["A"], ids["B"]]
            ),
            SamplingParams(max_tokens=12, temperature=0.0, bad_words=["Paris"]),
            SamplingParams(max_tokens=1, temperature=0.0, logprob_token_ids=[ids[" London"]]),
            # Two tokens, " Paris" then ".": the second is banned only after the first.
            SamplingParams(max_tokens=4, temperature=0.0, bad_words=["Paris."]),
            SamplingParams(max_tokens=4, temperature=0.0),
        ]
        # One batch: rows with different controls side by side.
        outs = [o.outputs[0] for o in llm.generate([PROMPT] * 6, params, use_tqdm=False)]
        assert outs[0].text == " banana banana banana"
        assert re.fullmatch("[AB]{8}", outs[1].text)
        assert "Paris" not in outs[2].text
        assert outs[3].logprobs is not None
        assert set(outs[3].logprobs[0]) == {ids[" Paris"], ids[" London"]}
        assert outs[5].text.startswith(" Paris.")
        assert outs[4].text.startswith(" Paris") and not outs[4].text.startswith(" Paris.")
        with pytest.raises(ValueError, match="allowed_token_ids"):
            llm.generate(PROMPT, SamplingParams(allowed_token_ids=[]), use_tqdm=False)
    finally:
        llm.shutdown()
