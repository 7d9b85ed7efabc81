"""Tools as clients write them (vLLM compatibility): pydantic ``parameters`` with ``$defs``
under ``tool_choice: "required"``, ``response_format`` next to a forced tool, and calls cut
short by ``max_tokens``."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from pydantic import BaseModel

from corefleet.engine.messages import StructuredOutputsParams
from corefleet.engine.openai.errors import RequestError, parse_request
from corefleet.engine.openai.protocol import ChatCompletionRequest
from corefleet.engine.openai.sampling_request import to_sampling_params
from corefleet.engine.openai.structured_request import check_constraint
from corefleet.engine.openai.tool_options import ToolOptions
from corefleet.engine.openai.tool_output import StreamedCalls, tool_finish_reason, whole_message
from corefleet.engine.openai.tool_request import ToolPlan, plan_tools

USER = {"role": "user", "content": "Search for shoes"}
AUTO = ToolOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")


class Opts(BaseModel):
    limit: int
    exact: bool


class Search(BaseModel):
    query: str
    opts: Opts


class Filter(BaseModel):  # another tool whose nested model has the same name, another shape
    class Opts(BaseModel):
        field: str

    opts: Opts
    also: list[Opts]


def _tool(name: str, model: type[BaseModel]) -> dict[str, Any]:
    parameters = model.model_json_schema()
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


TOOLS = [_tool("search", Search), _tool("filter", Filter)]
SEARCH_CALL = {
    "name": "search",
    "arguments": {"query": "shoes", "opts": {"limit": 3, "exact": True}},
}
FILTER_CALL = {
    "name": "filter",
    "arguments": {"opts": {"field": "size"}, "also": [{"field": "color"}]},
}


def _params(**fields: Any) -> tuple[ToolPlan, StructuredOutputsParams | None]:
    """What the API does before queueing: plan, sampling params, the grammar's own check."""
    body = parse_request(ChatCompletionRequest, {"messages": [USER], **fields})
    plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, AUTO)
    params = to_sampling_params(body, None, plan.constraint)
    check_constraint(params.structured_outputs, body)
    return plan, params.structured_outputs


def test_pydantic_parameters_with_defs_work_under_required() -> None:
    assert "$defs" in TOOLS[0]["function"]["parameters"]  # what pydantic writes
    before = json.dumps(TOOLS)
    _, params = _params(tools=TOOLS, tool_choice="required")
    assert params is not None and params.json is not None
    assert json.dumps(TOOLS) == before  # the request's own schemas are not changed
    schema = json.loads(params.json)
    assert set(schema["$defs"]) == {"search.Opts", "filter.Opts"}  # no collision
    jsonschema.validate([SEARCH_CALL, FILTER_CALL], schema)
    wrong_opts = {"name": "filter", "arguments": {"opts": {"limit": 3, "exact": True}, "also": []}}
    for wrong in ([wrong_opts], [{**SEARCH_CALL, "arguments": {"query": "x", "opts": {}}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)


def test_definitions_and_refs_to_the_tool_s_own_root_are_moved_too() -> None:
    tree = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "children": {"$ref": "#/definitions/Kids"}},
        "required": ["name"],
        "definitions": {"Kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}},
    }
    tools = [{"type": "function", "function": {"name": "tree", "parameters": tree}}]
    _, params = _params(tools=tools, tool_choice="required")
    assert params is not None and params.json is not None
    schema = json.loads(params.json)
    call = {"name": "tree", "arguments": {"name": "a", "children": [{"name": "b"}]}}
    jsonschema.validate([call], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{**call, "arguments": {"name": "a", "children": [{"x": 1}]}}], schema)


def test_a_named_tool_keeps_its_defs_at_the_root() -> None:
    named = {"type": "function", "function": {"name": "search"}}
    _, params = _params(tools=TOOLS, tool_choice=named)
    assert params is not None and params.json is not None
    jsonschema.validate(SEARCH_CALL["arguments"], json.loads(params.json))


@pytest.mark.parametrize(
    "other",
    [
        {"response_format": {"type": "json_object"}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
        {"structured_outputs": {"regex": "[a-z]+"}},
        {"guided_choice": ["a", "b"]},
    ],
)
def test_a_forced_tool_replaces_any_other_constraint(other: dict[str, Any]) -> None:
    required, params = _params(tools=TOOLS, tool_choice="required", **other)
    assert params is not None and params.json == (required.constraint and required.constraint.json)
    named = {"type": "function", "function": {"name": "search"}}
    forced, params = _params(tools=TOOLS, tool_choice=named, **other)
    assert params is not None and params.json == (forced.constraint and forced.constraint.json)
    # Under auto or none, the tools constrain nothing: the other field is the constraint.
    _, params = _params(tools=TOOLS, tool_choice="none", **other)
    assert params is not None and params.json != (forced.constraint and forced.constraint.json)


def test_a_dropped_constraint_is_still_checked_for_its_shape() -> None:
    with pytest.raises(RequestError) as err:
        _params(tools=TOOLS, tool_choice="required", response_format={"type": "yaml"})
    assert err.value.param == "response_format"


def test_tool_parameters_allow_no_undeclared_keys_by_default() -> None:
    _, params = _params(tools=TOOLS, tool_choice="required")
    assert params is not None and params.disable_additional_properties is True
    loose = {"structured_outputs": {"disable_additional_properties": False}}
    _, params = _params(tools=TOOLS, tool_choice="required", **loose)
    assert params is not None and params.disable_additional_properties is False


def _plan(**fields: Any) -> ToolPlan:
    return _params(tools=TOOLS, **fields)[0]


CUT_REQUIRED = '[{"name": "search", "arguments": {"query": "sh'
CUT_AUTO = 'Sure. <tool_call>{"name": "search", "arguments": {"qu'


@pytest.mark.parametrize(
    ("fields", "text", "content"),
    [
        ({"tool_choice": "required"}, CUT_REQUIRED, None),
        ({"tool_choice": "required"}, "[", None),
        ({"tool_choice": {"type": "function", "function": {"name": "search"}}}, "{", None),
        ({"tool_choice": "auto"}, CUT_AUTO, "Sure. "),
    ],
)
def test_a_call_cut_by_max_tokens_is_not_returned(
    fields: dict[str, Any], text: str, content: str | None
) -> None:
    plan = _plan(**fields)
    message, called = whole_message(plan, text, "length")
    assert (message.content, message.tool_calls, called) == (content, None, False)
    assert tool_finish_reason(plan, called, "length") == "length"
    stream = StreamedCalls(plan)
    deltas = [d for char in text for d in stream.feed(char)] + stream.finish("length")
    assert not [d for d in deltas if "tool_calls" in d]
    assert "".join(d.get("content", "") for d in deltas) == (content or "")


def test_calls_completed_before_the_cut_stay_calls() -> None:
    plan = _plan(tool_choice="required")
    text = json.dumps([SEARCH_CALL])[:-1] + ', {"name": "filter", "argu'
    message, called = whole_message(plan, text, "length")
    assert called and message.content is None
    assert [c.function.name for c in message.tool_calls or []] == ["search"]
