"""``corefleet serve`` on SmolLM2: completions ``echo``, vLLM's ``prompt_logprobs`` and
``usage.prompt_tokens_details.cached_tokens``, through the official client and raw HTTP.

The log-likelihood check is what lm-evaluation-harness does through the API: the prompt is the
context and the continuation, ``echo`` with ``max_tokens: 0`` returns the logprobs of the prompt
tokens, and the continuation's are summed; transformers' float32 forward pass is the reference.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch

from tests.serve_support import running_serve

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
BLOCK_SIZE = 16
FLAGS = (
    *("--dtype", "float32", "--kv-cache-dtype", "float32"),
    *("--kv-cache-memory", str(256 << 20), "--block-size", str(BLOCK_SIZE)),
    "--enable-prompt-tokens-details",
)
CONTEXT = "The capital of France is"
CONTINUATION = " Paris, which is also its largest city"


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    with running_serve(*FLAGS) as url:
        yield url


@pytest.fixture(scope="module")
def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="x", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(smollm2_path: str) -> Any:
    from corefleet.engine.frontend.tokenizer import Tokenizer

    return Tokenizer.from_model_path(smollm2_path)


def _post(base: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{base}{path}", json={"model": MODEL, **body}, timeout=120)


@torch.inference_mode()
def _hf_logprobs(model: Any, ids: list[int]) -> torch.Tensor:
    """transformers' float32 log-softmax at every position of ``ids``: ``[P, V]``."""
    logits = model(torch.tensor([ids])).logits[0]  # [P, V]
    return torch.log_softmax(logits.float(), dim=-1)


def test_loglikelihood_through_echo_equals_transformers(
    client: openai.OpenAI, tokenizer: Any, hf_smollm2: Any
) -> None:
    context = tokenizer.encode(CONTEXT, add_special_tokens=False)
    continuation = tokenizer.encode(CONTINUATION, add_special_tokens=False)
    ids = context + continuation
    out = client.completions.create(
        model=MODEL, prompt=ids, echo=True, max_tokens=0, logprobs=1, temperature=0.0
    )
    (choice,) = out.choices
    assert choice.text == tokenizer.decode(ids, skip_special_tokens=False)
    lp = choice.logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.token_logprobs) == len(ids)  # the prompt alone: the engine's token dropped
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert out.usage is not None and out.usage.completion_tokens == 0

    reference = _hf_logprobs(hf_smollm2, ids)
    expected = sum(reference[p - 1, ids[p]].item() for p in range(len(context), len(ids)))
    served = lp.token_logprobs[len(context) :]
    assert all(x is not None for x in served)
    total = sum(x for x in served if x is not None)
    assert total == pytest.approx(expected, abs=0.02 * len(continuation))
    # lm-eval's is_greedy: every continuation token is its position's top candidate.
    greedy = all(reference[p - 1].argmax().item() == ids[p] for p in range(len(context), len(ids)))
    top = lp.top_logprobs[len(context) :]
    served_greedy = all(
        t is not None and max(t, key=lambda k: t[k]) == tok
        for t, tok in zip(top, lp.tokens[len(context) :], strict=True)
    )
    assert served_greedy == greedy


def test_echo_with_output_and_text_offsets(client: openai.OpenAI, tokenizer: Any) -> None:
    n_prompt = len(tokenizer.encode(CONTEXT))
    out = client.completions.create(
        model=MODEL, prompt=CONTEXT, echo=True, max_tokens=4, logprobs=2, temperature=0.0
    )
    (choice,) = out.choices
    plain = client.completions.create(model=MODEL, prompt=CONTEXT, max_tokens=4, temperature=0.0)
    assert choice.text == CONTEXT + plain.choices[0].text
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.text_offset is not None
    assert len(lp.tokens) == n_prompt + 4
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert all(x is not None for x in (lp.token_logprobs or [])[1:])
    # Prompt entries hold the prompt token and the top 2, so at most 3 distinct texts.
    assert all(t is not None and 1 <= len(t) <= 3 for t in (lp.top_logprobs or [])[1:])


def test_echo_streams_the_prompt_first(base: str) -> None:
    body = {"prompt": CONTEXT, "echo": True, "max_tokens": 3, "temperature": 0.0, "stream": True}
    texts: list[str] = []
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                texts.extend(c["text"] for c in json.loads(line[6:])["choices"])
    whole = _post(base, "/v1/completions", {**body, "stream": False}).json()
    assert texts[0].startswith(CONTEXT) and "".join(texts) == whole["choices"][0]["text"]


def test_prompt_logprobs_on_both_endpoints(base: str, tokenizer: Any) -> None:
    ids = tokenizer.encode(CONTEXT)
    got = _post(base, "/v1/completions", {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 2})
    assert got.status_code == 200, got.text
    rows = got.json()["choices"][0]["prompt_logprobs"]
    assert len(rows) == len(ids) and rows[0] is None
    for position, row in enumerate(rows[1:], start=1):
        assert str(ids[position]) in row and 1 <= len(row) <= 3
        # The top 2 (ranks 1 and 2), and the prompt token with its own rank if not among them.
        assert sorted(entry["rank"] for entry in row.values())[:2] == [1, 2]
        assert all(entry["decoded_token"] is not None for entry in row.values())
    chat = _post(
        base,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "prompt_logprobs": 0},
    )
    assert chat.status_code == 200, chat.text
    rows = chat.json()["prompt_logprobs"]
    assert rows[0] is None and len(rows) > 3
    assert all(len(row) == 1 and next(iter(row.values()))["rank"] >= 1 for row in rows[1:])


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt_logprobs": 10**12}, "prompt_logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 0, "echo": False}, "max_tokens"),
        ({"max_tokens": -1, "echo": True}, "max_tokens"),
    ],
)
def test_bad_values_are_400s(base: str, body: dict[str, Any], param: str) -> None:
    got = _post(base, "/v1/completions", {"prompt": CONTEXT, **body})
    assert got.status_code == 400, got.text
    assert got.json()["error"]["param"] == param


def test_cached_tokens_reported_per_request(client: openai.OpenAI) -> None:
    # A prompt no other test sends: nothing of it is cached before the first request.
    prompt = "cached-tokens check: " + " ".join(f"word{i}" for i in range(60))
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert first.usage is not None and first.usage.prompt_tokens > 3 * BLOCK_SIZE
    assert first.usage.prompt_tokens_details is None  # nothing cached: left out, as vLLM
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and cached > 0 and cached % BLOCK_SIZE == 0
    assert cached < again.usage.prompt_tokens
    # Prompt logprobs need every position's logits: the cache is not read for them.
    scored = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    assert scored.usage is not None and scored.usage.prompt_tokens_details is None
