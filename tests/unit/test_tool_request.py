"""Tool calling around the model: what ``tools``/``tool_choice`` mean for the prompt and the
constraint (``tool_request``), the server's flags (``tool_options``), and how a choice's text
becomes ``tool_calls`` (``tool_output``)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from corefleet.engine.openai import limits
from corefleet.engine.openai.errors import RequestError, parse_request
from corefleet.engine.openai.protocol import ChatCompletionRequest
from corefleet.engine.openai.sampling_request import to_sampling_params
from corefleet.engine.openai.structured_request import check_constraint
from corefleet.engine.openai.tool_options import ToolOptions
from corefleet.engine.openai.tool_output import StreamedCalls, tool_finish_reason, whole_message
from corefleet.engine.openai.tool_request import ToolPlan, plan_tools, template_inputs

ARGS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": ARGS}},
    {"type": "function", "function": {"name": "get_time"}},
]
USER = {"role": "user", "content": "Weather in Paris?"}
AUTO = ToolOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)
WITH_TOOLS = "{% if tools %}{{ tools | tojson }}{% endif %}" + CHATML


def _request(**fields: Any) -> ChatCompletionRequest:
    return parse_request(ChatCompletionRequest, {"messages": [USER], **fields})


def _plan(options: ToolOptions = AUTO, **fields: Any) -> ToolPlan:
    body = _request(**fields)
    return plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, options)


def _refusal(options: ToolOptions = AUTO, **fields: Any) -> RequestError:
    with pytest.raises(RequestError) as err:
        body = _request(**fields)
        plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, options)
        params = to_sampling_params(body, None, plan.constraint)
        check_constraint(params.structured_outputs, body)
    assert err.value.status == 400
    return err.value


def test_tools_default_to_auto_which_needs_the_server_s_flag() -> None:
    assert _plan(tools=TOOLS).mode == "auto" and _plan(tools=TOOLS).parser == "hermes"
    err = _refusal(ToolOptions(), tools=TOOLS)
    assert (err.param, err.code) == ("tool_choice", "invalid_tool_choice")
    assert "--enable-auto-tool-choice" in err.message
    assert _plan(ToolOptions(), tools=TOOLS, tool_choice="none").mode == "none"


def test_tool_choice_must_name_an_offered_function() -> None:
    for choice in ("required", "auto", {"type": "function", "function": {"name": "get_time"}}):
        assert _refusal(tool_choice=choice).param == "tool_choice"  # no tools at all
    assert _plan(tool_choice="none").mode == "none"
    named = {"type": "function", "function": {"name": "get_stock" * 1000}}
    err = _refusal(tools=TOOLS, tool_choice=named)
    assert err.code == "invalid_tool_choice" and len(err.message) < 200
    twice = [TOOLS[0], TOOLS[0]]
    assert _refusal(tools=twice, tool_choice="required").param == "tools"


def test_a_named_function_constrains_the_output_to_its_arguments() -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    plan = _plan(tools=TOOLS, tool_choice=named)
    assert plan.mode == "named" and plan.function == "get_weather"
    assert plan.constraint is not None and json.loads(plan.constraint.json or "") == ARGS
    bare = _plan(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert bare.constraint is not None and json.loads(bare.constraint.json or "") == {
        "type": "object"
    }


def test_required_constrains_the_output_to_an_array_of_valid_calls() -> None:
    plan = _plan(tools=TOOLS, tool_choice="required")
    assert plan.constraint is not None
    schema = json.loads(plan.constraint.json or "")
    jsonschema.validate([{"name": "get_weather", "arguments": {"city": "Rome"}}], schema)
    jsonschema.validate([{"name": "get_time", "arguments": {}}] * 3, schema)
    for wrong in (
        [],
        [{"name": "get_stock", "arguments": {}}],
        [{"name": "get_weather", "arguments": {}}],  # city is required
        [{"name": "get_time"}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    one = _plan(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert one.constraint is not None
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(
            [{"name": "get_time", "arguments": {}}] * 2, json.loads(one.constraint.json or "")
        )


def test_a_bad_parameters_schema_or_a_free_end_is_a_400() -> None:
    broken = [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]
    err = _refusal(tools=broken, tool_choice="required")
    assert (err.param, err.code) == ("tools", "invalid_grammar")
    huge = {"type": "object", "description": "x" * limits.MAX_GRAMMAR_CHARS}
    big = [{"type": "function", "function": {"name": "f", "parameters": huge}}]
    assert _refusal(tools=big, tool_choice="required").param == "tools"
    assert _refusal(tools=TOOLS, tool_choice="required", ignore_eos=True).param == "ignore_eos"


@pytest.mark.parametrize(
    "tools",
    [
        [TOOLS[0]] * (limits.MAX_TOOLS + 1),
        [{"type": "function", "function": {"name": "a" * 65}}],
        [{"type": "function", "function": {"name": "no spaces"}}],
        [{"type": "retrieval", "function": {"name": "f"}}],
    ],
)
def test_absurd_or_malformed_tools_are_400s_naming_tools(tools: list[Any]) -> None:
    with pytest.raises(RequestError) as err:
        _request(tools=tools)
    assert err.value.status == 400 and err.value.param is not None
    assert err.value.param.startswith("tools")


def test_deeply_nested_parameters_are_a_400_not_a_crash() -> None:
    depth = 100_000
    parameters = '{"a": ' * depth + "1" + "}" * depth
    tool = '{"type": "function", "function": {"name": "f", "parameters": ' + parameters + "}}"
    body = '{"messages": [{"role": "user", "content": "hi"}], "tools": [' + tool + "]}"
    with pytest.raises(RequestError) as err:
        parse_request(ChatCompletionRequest, body)
    assert err.value.status == 400 and "recursion limit" in err.value.message


def test_the_server_flags_follow_vllm_s_rules() -> None:
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        ToolOptions(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="hermes"):
        ToolOptions(tool_call_parser="mistral")
    assert ToolOptions(tool_call_parser="llama3_json").auto_parser is None


def test_a_template_that_reads_tools_gets_them_and_past_calls_as_objects() -> None:
    call = {"id": "call_1", "type": "function"}
    past = [
        USER,
        call | {"function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        call | {"id": "call_2", "function": {"name": "get_time", "arguments": "not json"}},
    ]
    body = _request(messages=[USER, {"role": "assistant", "tool_calls": past[1:]}], tools=TOOLS)
    messages = body.template_messages()
    calls = messages[1]["tool_calls"]
    assert calls[0]["function"]["arguments"] == {"city": "Paris"}
    assert calls[1]["function"]["arguments"] == "not json"  # kept as sent
    plan = _plan(tools=TOOLS)
    shown, variables = template_inputs(messages, plan, WITH_TOOLS)
    assert shown == messages and [t["function"]["name"] for t in variables["tools"]] == [
        "get_weather",
        "get_time",
    ]


def test_a_template_that_ignores_tools_gets_them_in_the_system_message() -> None:
    past = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    body = _request(
        messages=[
            {"role": "system", "content": "Be brief."},
            USER,
            {"role": "assistant", "content": None, "tool_calls": [past]},
            {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
        ],
        tools=TOOLS,
    )
    messages, variables = template_inputs(body.template_messages(), _plan(tools=TOOLS), CHATML)
    assert variables == {}
    system = messages[0]["content"]
    assert system.startswith("Be brief.\n\n") and '"name": "get_weather"' in system
    assert "<tool_call>" in system and len(messages) == 4
    assert (
        messages[2]["content"] == '<tool_call>[{"name": "get_time", "arguments": {}}]</tool_call>'
    )
    assert messages[3] == {"role": "tool", "content": "12:00", "tool_call_id": "c1"}
    plain, _ = template_inputs(
        body.template_messages(), _plan(tools=TOOLS, tool_choice="none"), CHATML
    )
    assert plain[0]["content"] == "Be brief."  # tool_choice none: nothing added


def test_the_answer_s_text_becomes_tool_calls_and_the_finish_reason_says_so() -> None:
    auto = _plan(tools=TOOLS)
    text = 'Let me see. <tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    message, called = whole_message(auto, text)
    assert called and message.content == "Let me see. "
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls or []] == [
        ("get_time", "{}")
    ]
    assert tool_finish_reason(auto, called, "stop") == "tool_calls"
    assert tool_finish_reason(auto, called, "length") == "length"
    assert tool_finish_reason(auto, False, "stop") == "stop"
    plain, called = whole_message(auto, "Sunny.")
    assert (plain.content, plain.tool_calls, called) == ("Sunny.", None, False)
    two = '[{"name": "get_time", "arguments": {}}, {"name": "get_time", "arguments": {}}]'
    single = _plan(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert (
        len(whole_message(_plan(tools=TOOLS, tool_choice="required"), two)[0].tool_calls or []) == 2
    )
    assert len(whole_message(single, two)[0].tool_calls or []) == 1
    named = _plan(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    message, called = whole_message(named, "{}")
    assert message.content is None and (message.tool_calls or [])[0].function.arguments == "{}"
    assert tool_finish_reason(named, called, "stop") == "stop"  # forced: stop, as at OpenAI


def test_a_named_function_streams_its_call_whole_when_its_arguments_end() -> None:
    named = _plan(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    stream = StreamedCalls(named)
    assert stream.feed('{"ci') + stream.feed("") + stream.feed('ty": "Oslo"}') == []
    (delta,) = stream.finish("stop")
    (call,) = delta["tool_calls"]
    assert call["id"].startswith("call_") and call["index"] == 0
    assert call["function"] == {"name": "get_time", "arguments": '{"city": "Oslo"}'}


def test_parallel_tool_calls_false_streams_the_first_call_only() -> None:
    block = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    stream = StreamedCalls(_plan(tools=TOOLS, parallel_tool_calls=False))
    deltas = stream.feed("ok " + block) + stream.feed(block) + stream.finish()
    assert deltas[0] == {"content": "ok "}
    assert [d["tool_calls"][0]["index"] for d in deltas[1:]] == [0]
    assert stream.calls == 1
