"""Tool calling on ``corefleet serve`` with the embedded SmolLM2, through the official client.

SmolLM2-135M's chat template does not render ``tools``, so the server describes them in the
system message and writes earlier calls back as ``<tool_call>`` blocks (``tool_request``);
with two earlier calls in the conversation the model calls the tool by itself under ``auto``.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from tests.serve_support import running_serve

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
FLAGS = ("--dtype", "float32", "--kv-cache-memory", str(256 << 20))
WEATHER_ARGS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}},
    "required": ["city"],
    "additionalProperties": False,
}
TIME_ARGS = WEATHER_ARGS | {
    "properties": {"city": {"type": "string", "maxLength": 30}, "utc": {"type": "boolean"}},
    "required": ["city", "utc"],
}
TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city now",
            "parameters": WEATHER_ARGS,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time in a city",
            "parameters": TIME_ARGS,
        },
    },
]
SCHEMAS = {"get_weather": WEATHER_ARGS, "get_time": TIME_ARGS}


def _called(city: str, call_id: str) -> dict[str, Any]:
    arguments = json.dumps({"city": city})
    call = {
        "id": call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": arguments},
    }
    return {"role": "assistant", "content": None, "tool_calls": [call]}


# Two earlier rounds of call and result (role: tool), then a new question.
CONVERSATION: Any = [
    {"role": "user", "content": "Weather in Paris?"},
    _called("Paris", "call_1"),
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    {"role": "user", "content": "Weather in Rome?"},
    _called("Rome", "call_2"),
    {"role": "tool", "tool_call_id": "call_2", "content": "25 C"},
    {"role": "user", "content": "Weather in London?"},
]


def _valid_call(name: str, arguments: str) -> dict[str, Any]:
    """The arguments of a call, checked against the tool's schema."""
    parsed = json.loads(arguments)
    jsonschema.validate(parsed, SCHEMAS[name])
    return dict(parsed)


def _streamed_calls(stream: Any) -> tuple[str, list[tuple[str, str]], str | None]:
    """Content, calls (name, arguments) and finish reason, put together from a stream's deltas
    the way an OpenAI client does: by each call's ``index``."""
    content, calls, ids, finish = "", {}, set(), None
    for chunk in stream:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for piece in choice.delta.tool_calls or []:
            if piece.id is not None:
                ids.add(piece.id)
                calls[piece.index] = [piece.function.name, ""]
            calls[piece.index][1] += piece.function.arguments or ""
        finish = choice.finish_reason or finish
    assert len(ids) == len(calls)  # each call's id comes once, in its first piece
    return content, [(n, a) for n, a in (calls[i] for i in sorted(calls))], finish


def test_auto_required_and_named_tool_calls() -> None:
    with running_serve(*FLAGS, "--enable-auto-tool-choice", "--tool-call-parser", "hermes") as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", timeout=120, max_retries=0)
        ask: Any = {"model": MODEL, "tools": TOOLS, "max_tokens": 60, "temperature": 0.0}

        # auto: the model chose the tool; its text became a call and the reason says so.
        auto = client.chat.completions.create(messages=CONVERSATION, **ask).choices[0]
        assert auto.finish_reason == "tool_calls" and auto.message.content is None
        (call,) = auto.message.tool_calls or []
        assert call.function.name == "get_weather" and call.id.startswith("call_")
        assert _valid_call(call.function.name, call.function.arguments) == {"city": "London"}
        content, calls, finish = _streamed_calls(
            client.chat.completions.create(messages=CONVERSATION, stream=True, **ask)
        )
        assert (content, finish) == ("", "tool_calls")
        assert calls == [("get_weather", call.function.arguments)]

        # required, one call: the constraint makes it parse and follow the schema.
        question: Any = [{"role": "user", "content": "What time is it in Tokyo?"}]
        required = client.chat.completions.create(
            messages=question, tool_choice="required", parallel_tool_calls=False, **ask
        ).choices[0]
        assert required.finish_reason == "tool_calls"
        (call,) = required.message.tool_calls or []
        _valid_call(call.function.name, call.function.arguments)

        # A named function, streamed: its call arrives whole, and validates.
        named: Any = {"type": "function", "function": {"name": "get_time"}}
        content, calls, finish = _streamed_calls(
            client.chat.completions.create(messages=question, tool_choice=named, stream=True, **ask)
        )
        assert content == "" and finish == "stop" and [n for n, _ in calls] == ["get_time"]
        _valid_call("get_time", calls[0][1])

        # none: plain text, no calls.
        plain = client.chat.completions.create(messages=question, tool_choice="none", **ask)
        assert plain.choices[0].message.tool_calls is None
        assert plain.choices[0].message.content

        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                messages=question,
                tool_choice={"type": "function", "function": {"name": "get_stock_price"}},
                **ask,
            )
        assert err.value.body["param"] == "tool_choice"  # type: ignore[index]
        assert err.value.body["code"] == "invalid_tool_choice"  # type: ignore[index]
