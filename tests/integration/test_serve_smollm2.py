"""``corefleet serve`` on the embedded SmolLM2: the API answers what the offline LLM answers."""

from __future__ import annotations

import re

import openai
import pydantic
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


class City(pydantic.BaseModel):
    """What ``parse`` asks for: OpenAI's strict json_schema of a pydantic model."""

    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)
    population_millions: int = pydantic.Field(ge=0, le=100)


def test_structured_outputs_through_the_official_client() -> None:
    with running_serve(*FLAGS) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", timeout=120, max_retries=0)
        model = "SmolLM2-135M-Instruct"
        parsed = client.beta.chat.completions.parse(
            model=model,
            messages=[{"role": "user", "content": "Describe Paris as JSON."}],
            response_format=City,
            max_tokens=96,
            temperature=0.0,
        )
        choice = parsed.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, City)
        streamed = client.completions.create(
            model=model,
            prompt="The year the Eiffel Tower was built:",
            max_tokens=8,
            temperature=0.0,
            stream=True,
            extra_body={"guided_regex": "1[0-9]{3}"},
        )
        text = "".join(c.choices[0].text for c in streamed if c.choices)
        assert re.fullmatch("1[0-9]{3}", text)
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model=model,
                messages=QUESTION,  # type: ignore[arg-type]
                max_tokens=8,
                extra_body={"guided_json": {"type": "object", "properties": {"a": {"type": 5}}}},
            )
        assert err.value.body["param"] == "guided_json"  # type: ignore[index]
