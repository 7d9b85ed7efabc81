"""The Responses API (``/v1/responses``) through ``corefleet serve`` on SmolLM2: the official
client's ``responses`` resource (whole, streamed, with tools, continued by
``previous_response_id``) and raw HTTP for what a client library hides."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from corefleet.engine.openai.responses_api import MAX_STORED_RESPONSES
from tests.serve_support import running_serve

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
FLAGS = ("--dtype", "float32", "--kv-cache-memory", str(256 << 20))
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    with running_serve(*FLAGS) as url:
        yield url


@pytest.fixture(scope="module")
def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="x", timeout=120)


def test_a_response_equals_the_chat_completion_it_amounts_to(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": "What colour is the sky?"},
        ],
        max_completion_tokens=12,
        temperature=0.0,
    )
    response = client.responses.create(
        model=MODEL,
        instructions="Answer in one word.",
        input="What colour is the sky?",
        max_output_tokens=12,
        temperature=0.0,
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == chat.choices[0].message.content
    assert response.usage is not None and chat.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    expected = "completed" if chat.choices[0].finish_reason == "stop" else "incomplete"
    assert response.status == expected


def test_cut_short_is_incomplete(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL, input="Tell me a long story.", max_output_tokens=3, temperature=0.0
    )
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and response.usage.output_tokens == 3


def test_streamed_events_spell_the_same_answer(client: openai.OpenAI) -> None:
    kwargs = {"model": MODEL, "input": "Say hello.", "max_output_tokens": 10, "temperature": 0.0}
    whole = client.responses.create(**kwargs)  # type: ignore[call-overload]
    events = list(client.responses.create(stream=True, **kwargs))  # type: ignore[call-overload]
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed" if whole.status == "completed" else "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text


def test_a_continuation_sees_the_stored_conversation(client: openai.OpenAI, base: str) -> None:
    first = client.responses.create(
        model=MODEL, input="My name is Ada.", max_output_tokens=8, temperature=0.0
    )
    second = client.responses.create(
        model=MODEL,
        input="What is my name?",
        previous_response_id=first.id,
        max_output_tokens=8,
        temperature=0.0,
    )
    assert first.usage is not None and second.usage is not None
    # The second prompt holds the first turn and its answer.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).output_text == first.output_text
    deleted = httpx.delete(f"{base}/v1/responses/{first.id}", timeout=30)
    assert deleted.json() == {"id": first.id, "object": "response.deleted", "deleted": True}
    gone = httpx.post(
        f"{base}/v1/responses",
        json={"input": "Again?", "previous_response_id": first.id},
        timeout=60,
    )
    assert gone.status_code == 404
    assert gone.json()["error"]["param"] == "previous_response_id"
    not_stored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    missing = httpx.get(f"{base}/v1/responses/{not_stored.id}", timeout=30)
    assert missing.status_code == 404 and str(MAX_STORED_RESPONSES) in missing.text


def test_required_tool_gives_a_function_call_item(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="required",
        max_output_tokens=60,
        temperature=0.0,
    )
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    assert set(json.loads(calls[0].arguments)) == {"city"}
    # The call's output goes back as the next input; the model then answers in text.
    follow = client.responses.create(
        model=MODEL,
        previous_response_id=response.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}],
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="none",
        max_output_tokens=10,
        temperature=0.0,
    )
    assert follow.output[0].type == "message"
    streamed = list(
        client.responses.create(
            model=MODEL,
            input="What is the weather in Paris?",
            tools=[WEATHER],  # type: ignore[list-item]
            tool_choice="required",
            max_output_tokens=60,
            temperature=0.0,
            stream=True,
        )
    )
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [calls[0].arguments]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
        ({"input": [{"role": "user", "content": "x"}] * 100_000}, "input"),
        ({"input": "x", "model": "other"}, "model"),
    ],
)
def test_refusals_name_the_field(base: str, body: dict, param: str) -> None:
    reply = httpx.post(f"{base}/v1/responses", json=body, timeout=60)
    assert 400 <= reply.status_code < 500, reply.text
    assert reply.json()["error"]["param"] == param
