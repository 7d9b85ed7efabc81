"""``corefleet serve`` on the embedded SmolLM2: the API answers what the offline LLM answers."""

from __future__ import annotations

import openai
import pytest

from corefleet.engine import LLM, SamplingParams
from tests.serve_support import running_serve

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
FLAGS = ("--dtype", "float32", "--kv-cache-memory", str(256 << 20))


def test_serve_equals_offline_on_smollm2() -> None:
    llm = LLM(multiprocess=False, dtype="float32", kv_cache_memory=256 << 20)
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    expected_text = llm.generate(PROMPT, greedy, use_tqdm=False)[0].outputs[0].text
    expected_chat = llm.chat(QUESTION, greedy, use_tqdm=False)[0].outputs[0].text
    llm.shutdown()

    with running_serve(*FLAGS) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", timeout=120)
        assert [m.id for m in client.models.list()] == ["SmolLM2-135M-Instruct"]
        completion = client.completions.create(
            model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=24, temperature=0.0
        )
        assert completion.choices[0].text == expected_text
        stream = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=QUESTION,  # type: ignore[arg-type]
            max_tokens=24,
            temperature=0.0,
            stream=True,
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert streamed == expected_chat and "Paris" in streamed
