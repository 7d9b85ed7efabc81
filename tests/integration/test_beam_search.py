"""Beam search (``use_beam_search``) through ``corefleet serve`` on SmolLM2, against the same
search run on transformers' float32 logits, with the official client and raw HTTP."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch

from corefleet.engine.frontend.tokenizer import Tokenizer
from tests.serve_support import running_serve

pytestmark = pytest.mark.slow

PROMPT = "The three primary colours are"
FLAGS = ("--dtype", "float32", "--kv-cache-dtype", "float32", "--kv-cache-memory", str(256 << 20))


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    with running_serve(*FLAGS) as url:
        yield url


def reference_beams(
    model: Any, prompt: list[int], width: int, steps: int, eos: int, penalty: float = 1.0
) -> list[list[int]]:
    """vLLM's beam search over transformers' logits: 2 × width candidates per beam and step,
    the width best by summed logprob kept, finished beams set aside, ranked at the end by
    logprob / len(prompt + tokens without EOS) ** penalty."""
    live: list[tuple[list[int], float]] = [([], 0.0)]
    done: list[tuple[list[int], float]] = []
    for _ in range(steps):
        extended = []
        for tokens, logprob in live:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + tokens])).logits[0, -1].float()
            top = torch.log_softmax(logits, dim=-1).topk(2 * width)
            for lp, token in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                extended.append(([*tokens, token], logprob + lp))
        extended.sort(key=lambda b: b[1], reverse=True)
        best = extended[:width]
        done += [b for b in best if b[0][-1] == eos]
        live = [b for b in best if b[0][-1] != eos]
        if not live:
            break

    def score(beam: tuple[list[int], float]) -> float:
        length = len(prompt) + len(beam[0]) - (1 if beam[0][-1] == eos else 0)
        return beam[1] / length**penalty

    return [b[0] for b in sorted(done + live, key=score, reverse=True)[:width]]


def test_beams_equal_the_reference_search(base: str, hf_smollm2: Any, smollm2_path: str) -> None:
    tok = Tokenizer.from_model_path(smollm2_path)
    prompt = tok.encode(PROMPT)
    assert tok.eos_token_id is not None
    expected = reference_beams(hf_smollm2, prompt, width=3, steps=6, eos=tok.eos_token_id)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", timeout=120)
    reply = client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt=PROMPT,
        n=3,
        max_tokens=6,
        extra_body={"use_beam_search": True},
    )
    texts = [c.text for c in reply.choices]
    assert texts == [tok.decode([t for t in b if t != tok.eos_token_id]) for b in expected]
    assert reply.usage is not None
    assert reply.usage.completion_tokens == sum(len(b) for b in expected)


def test_chat_and_streamed_beams(base: str) -> None:
    body = {
        "messages": [{"role": "user", "content": "Name a fruit."}],
        "n": 2,
        "max_tokens": 5,
        "use_beam_search": True,
    }
    whole = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120).json()
    assert [c["index"] for c in whole["choices"]] == [0, 1]
    with httpx.stream(
        "POST", f"{base}/v1/chat/completions", json=body | {"stream": True}, timeout=120
    ) as reply:
        lines = [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    streamed = [c["choices"][0]["delta"]["content"] for c in chunks]
    assert streamed == [c["message"]["content"] for c in whole["choices"]]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"n": 11}, "n"),
        ({"n": 2, "logprobs": 2}, "logprobs"),
        ({"n": 2, "response_format": {"type": "json_object"}}, "use_beam_search"),
        ({"n": 2, "use_beam_search": "yes"}, "use_beam_search"),
    ],
)
def test_what_beam_search_cannot_honour_is_refused(base: str, body: dict, param: str) -> None:
    request = {"prompt": PROMPT, "max_tokens": 4, "use_beam_search": True} | body
    reply = httpx.post(f"{base}/v1/completions", json=request, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
