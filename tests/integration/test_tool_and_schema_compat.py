"""What clients written for vLLM send, through the official client to ``corefleet serve`` on the
embedded SmolLM2: pydantic tools (``$defs``) under ``tool_choice: "required"``, calls cut short
by ``max_tokens``, JSON schemas that do not say ``additionalProperties``, and
``response_format`` next to a forced tool. One server for the module."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from pydantic import BaseModel, ConfigDict

from tests.integration.test_tool_calls_smollm2 import CONVERSATION, TOOLS
from tests.serve_support import running_serve

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
FLAGS = ("--dtype", "float32", "--kv-cache-memory", str(256 << 20))
GREEDY: Any = {"model": MODEL, "temperature": 0.0}


# Plain models, as clients write them: their schemas do not say additionalProperties. The
# answers are validated by the Strict variants, which refuse any key not declared.
FORBID = ConfigDict(extra="forbid")


class Options(BaseModel):
    max_results: int
    in_stock: bool


class SearchProducts(BaseModel):
    query: str
    options: Options


class StrictOptions(Options):
    model_config = FORBID


class StrictSearch(SearchProducts):
    model_config = FORBID
    options: StrictOptions


# As langchain's bind_tools and most agents write a pydantic tool: model_json_schema(), whose
# nested model is a $ref into $defs, and no additionalProperties anywhere.
SEARCH: Any = {
    "type": "function",
    "function": {
        "name": "SearchProducts",
        "description": "Search the catalogue",
        "parameters": SearchProducts.model_json_schema(),
    },
}
SHOES: Any = [{"role": "user", "content": "Find red running shoes, at most 5 results, in stock."}]
NAMED: Any = {"type": "function", "function": {"name": "SearchProducts"}}


class User(BaseModel):
    name: str
    age: int


class StrictUser(User):
    model_config = FORBID


PROFILE: Any = [
    {
        "role": "user",
        "content": "Give the full profile of a user as JSON, with their email, phone number and "
        "hobbies.",
    }
]
USER_FORMAT: Any = {
    "type": "json_schema",
    "json_schema": {"name": "user", "schema": User.model_json_schema()},
}


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    with running_serve(*FLAGS, "--enable-auto-tool-choice", "--tool-call-parser", "hermes") as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="x", timeout=120, max_retries=0)


def _stream(client: openai.OpenAI, **ask: Any) -> tuple[str, list[Any], str | None]:
    """The content, tool-call pieces and finish reason of a streamed choice."""
    content, pieces, finish = "", [], None
    for chunk in client.chat.completions.create(stream=True, **GREEDY, **ask):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        pieces += choice.delta.tool_calls or []
        finish = choice.finish_reason or finish
    return content, pieces, finish


def test_a_pydantic_tool_with_defs_under_required(client: openai.OpenAI) -> None:
    choice = client.chat.completions.create(
        messages=SHOES,
        tools=[SEARCH],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=100,
        **GREEDY,
    ).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "SearchProducts"
    StrictSearch.model_validate_json(call.function.arguments)  # the nested model, no extras


@pytest.mark.parametrize("tool_choice", ["required", NAMED, "auto"])
def test_a_call_cut_by_max_tokens_comes_back_as_no_call(
    client: openai.OpenAI, tool_choice: Any
) -> None:
    # Under auto, the conversation in which SmolLM2 calls get_weather by itself; 8 tokens cut
    # its <tool_call> block short (60 complete it: test_tool_calls_smollm2).
    ask: Any = (
        {"messages": CONVERSATION, "tools": TOOLS, "max_tokens": 8}
        if tool_choice == "auto"
        else {"messages": SHOES, "tools": [SEARCH], "tool_choice": tool_choice, "max_tokens": 3}
    )
    choice = client.chat.completions.create(**ask, **GREEDY).choices[0]
    assert choice.finish_reason == "length"
    assert (choice.message.tool_calls, choice.message.content) == (None, None)
    assert _stream(client, **ask) == ("", [], "length")


def test_json_schema_objects_allow_only_their_declared_keys(client: openai.OpenAI) -> None:
    # Asked for more than the schema holds: vLLM (xgrammar) gives the declared keys only.
    choice = client.chat.completions.create(
        messages=PROFILE, response_format=USER_FORMAT, max_tokens=80, **GREEDY
    ).choices[0]
    assert choice.finish_reason == "stop"
    StrictUser.model_validate_json(choice.message.content or "")
    # The same through structured_outputs.json (vLLM's form), streamed.
    content, _, finish = _stream(
        client,
        messages=PROFILE,
        max_tokens=80,
        extra_body={"structured_outputs": {"json": User.model_json_schema()}},
    )
    assert finish == "stop"
    StrictUser.model_validate_json(content)
    # vLLM's per-request switch turns it off: JSON Schema's letter, and SmolLM2 invents keys.
    loose = client.chat.completions.create(
        messages=PROFILE,
        response_format=USER_FORMAT,
        max_tokens=80,
        extra_body={"structured_outputs": {"disable_additional_properties": False}},
        **GREEDY,
    ).choices[0]
    keys = set(re.findall(r'"([^"]*)"\s*:', loose.message.content or ""))
    assert keys - {"name", "age"}


def test_the_openai_parse_helper_gets_its_model(client: openai.OpenAI) -> None:
    parsed = client.beta.chat.completions.parse(
        messages=PROFILE, response_format=User, max_tokens=80, **GREEDY
    )
    assert isinstance(parsed.choices[0].message.parsed, User)


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "json_object"},
        {"type": "json_schema", "json_schema": {"name": "z", "schema": {"type": "integer"}}},
    ],
)
@pytest.mark.parametrize("tool_choice", ["required", NAMED])
def test_response_format_next_to_a_forced_tool_gives_the_calls(
    client: openai.OpenAI, tool_choice: Any, response_format: Any
) -> None:
    choice = client.chat.completions.create(
        messages=SHOES,
        tools=[SEARCH],
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        response_format=response_format,
        max_tokens=100,
        **GREEDY,
    ).choices[0]
    assert choice.finish_reason == ("tool_calls" if tool_choice == "required" else "stop")
    (call,) = choice.message.tool_calls or []
    StrictSearch.model_validate_json(call.function.arguments)
