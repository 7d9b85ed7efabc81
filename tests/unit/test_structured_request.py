"""The API's constrained-output fields, mapped to the engine's ``StructuredOutputsParams``."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from corefleet.engine.cli import build_parser
from corefleet.engine.entrypoints.coordinator import CoordinatorOptions
from corefleet.engine.messages import SamplingParams, StructuredOutputsParams
from corefleet.engine.openai import limits
from corefleet.engine.openai.errors import RequestError
from corefleet.engine.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
)
from corefleet.engine.openai.sampling_request import to_sampling_params
from corefleet.engine.openai.structured_options import (
    StructuredOutputsConfig,
    parse_structured_outputs_config,
    structured_outputs_config_from_args,
)
from corefleet.engine.openai.structured_request import check_constraint
from corefleet.engine.structured_output.grammars import MAX_GBNF_CHARS

CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION: dict[str, Any] = {"model": "m", "prompt": "x"}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
# A JSON schema's objects are closed by default (vLLM's xgrammar): the params say so.
CLOSED = StructuredOutputsParams(json=json.dumps(SCHEMA), disable_additional_properties=True)


def _params(body: dict[str, Any], chat: bool = True) -> SamplingParams:
    """What the API does before queueing: the request's params, then its grammar's check."""
    model = ChatCompletionRequest if chat else CompletionRequest
    request = model.model_validate(body)
    params = to_sampling_params(request)
    check_constraint(params.structured_outputs, request)
    return params


def _refused(body: dict[str, Any], chat: bool = True) -> RequestError:
    with pytest.raises(RequestError) as err:
        _params(body, chat)
    assert err.value.status == 400
    return err.value


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        (
            "response_format",
            {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}},
            CLOSED,
        ),
        ("response_format", {"type": "json_object"}, StructuredOutputsParams(json_object=True)),
        ("structured_outputs", {"regex": "[0-9]+"}, StructuredOutputsParams(regex="[0-9]+")),
        ("structured_outputs", {"choice": ["a", "b"]}, StructuredOutputsParams(choice=["a", "b"])),
        ("structured_outputs", {"json": SCHEMA}, CLOSED),
        ("guided_json", SCHEMA, CLOSED),
        ("guided_regex", "a|b", StructuredOutputsParams(regex="a|b")),
        ("guided_choice", ["yes", "no"], StructuredOutputsParams(choice=["yes", "no"])),
        ("guided_grammar", 'root ::= "a" "b"', StructuredOutputsParams(grammar='root ::= "a" "b"')),
    ],
)
def test_every_way_to_ask_becomes_one_constraint(
    field: str, value: Any, expected: StructuredOutputsParams
) -> None:
    for chat, base in ((True, CHAT), (False, COMPLETION)):
        assert _params({**base, field: value}, chat).structured_outputs == expected


def test_text_format_and_nulls_constrain_nothing() -> None:
    body = {**CHAT, "response_format": {"type": "text"}, "guided_json": None}
    assert _params(body).structured_outputs is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"guided_json": {"type": "wat"}}, "guided_json"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": "(("}, "guided_regex"),
        ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
        ({"guided_grammar": ",\u00e9%w"}, "guided_grammar"),  # found by schemathesis: a 500
        ({"guided_regex": "a\udaef"}, "guided_regex"),  # a lone surrogate
        ({"guided_grammar": ""}, "guided_grammar"),  # found by schemathesis: a 500
        ({"guided_choice": []}, "guided_choice"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"regexp": "a"}}, "structured_outputs"),
        ({"response_format": {"type": "json_schema", "json_schema": 5}}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"guided_regex": "a", "ignore_eos": True}, "ignore_eos"),
        ({"guided_regex": "a", "min_tokens": 2}, "min_tokens"),
    ],
)
def test_a_bad_constraint_is_a_400_naming_its_field(body: dict[str, Any], param: str) -> None:
    assert _refused({**CHAT, **body}).param == param


def test_an_absurd_grammar_is_refused_by_its_size() -> None:
    huge = "a" * (100 * 1024 * 1024)  # 100 MB of regex
    error = _refused({**CHAT, "guided_regex": huge})
    assert error.param == "guided_regex" and str(limits.MAX_GRAMMAR_CHARS) in error.message
    # A schema nested 2,500 levels deep, within the size bound: deeper than a parser recurses.
    levels = 2_500
    deep = '{"type":"array","items":' * levels + '{"type":"object"}' + "}" * levels
    assert len(deep) < limits.MAX_GRAMMAR_CHARS
    assert _refused({**CHAT, "guided_json": deep}).param == "guided_json"
    choices = ["x"] * 1_000_000
    assert _refused({**CHAT, "guided_choice": choices}).param == "guided_choice"


def test_a_long_gbnf_grammar_is_refused_but_lark_of_the_same_length_is_not() -> None:
    # GBNF is converted to Lark in Python, in time quadratic in its rules: it has its own bound.
    rules = [f'r{i} ::= "x{i}" r{i + 1} | "y"' for i in range(400)]
    gbnf = "\n".join([*rules, 'r400 ::= "z"', "root ::= r0"])
    assert MAX_GBNF_CHARS < len(gbnf) < limits.MAX_GRAMMAR_CHARS
    error = _refused({**CHAT, "guided_grammar": gbnf})
    assert error.param == "guided_grammar" and "Lark" in error.message
    lark_rules = [f'r{i}: "x{i}" r{i + 1} | "y"' for i in range(400)]
    lark = "\n".join(["start: r0", *lark_rules, 'r400: "z"'])
    assert len(lark) > MAX_GBNF_CHARS
    assert _params({**CHAT, "guided_grammar": lark}).structured_outputs is not None


def test_disable_additional_properties_defaults_on_and_a_request_or_the_server_turns_it_off() -> (
    None
):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    assert _params({**CHAT, "response_format": fmt}).structured_outputs == CLOSED
    loose = {"json": SCHEMA, "disable_additional_properties": False}
    params = _params({**CHAT, "structured_outputs": loose}).structured_outputs
    assert params is not None and params.disable_additional_properties is False
    # vLLM's form: the options in structured_outputs, the constraint in response_format.
    options = {"structured_outputs": {"disable_additional_properties": False}}
    params = _params({**CHAT, "response_format": fmt, **options}).structured_outputs
    assert params == StructuredOutputsParams(
        json=json.dumps(SCHEMA), disable_additional_properties=False
    )
    server = StructuredOutputsConfig(disable_additional_properties=False)
    request = ChatCompletionRequest.model_validate({**CHAT, "guided_json": SCHEMA})
    params = to_sampling_params(request, None, None, server).structured_outputs
    assert params is not None and params.disable_additional_properties is False
    # Other kinds carry nothing: the option is about JSON schemas.
    regex = _params({**CHAT, "guided_regex": "a+"}).structured_outputs
    assert regex == StructuredOutputsParams(regex="a+")


@pytest.mark.parametrize(
    "value",
    [
        {"disable_additional_properties": False},  # options, but no constraint anywhere
        {"json": SCHEMA, "disable_additional_properties": "no"},
        {"json": SCHEMA, "disable_additional_properties": [True] * 1_000_000},
    ],
)
def test_a_bad_structured_outputs_option_is_a_400(value: dict[str, Any]) -> None:
    error = _refused({**CHAT, "structured_outputs": value})
    assert error.param == "structured_outputs" and len(error.message) < 300


def test_the_server_flag_reads_vllm_s_json() -> None:
    assert parse_structured_outputs_config("{}") == StructuredOutputsConfig()
    off = parse_structured_outputs_config('{"disable_additional_properties": false}')
    assert off.disable_additional_properties is False
    for bad in (
        "[]",
        "not json",
        '{"backend": "xgrammar"}',
        '{"disable_additional_properties": 1}',
    ):
        with pytest.raises(ValueError, match="--structured-outputs-config"):
            parse_structured_outputs_config(bad)


def test_the_flag_reaches_the_coordinator_options_of_both_commands() -> None:
    flag = ("--structured-outputs-config", '{"disable_additional_properties": false}')
    for command in (["serve"], ["coordinator"]):
        args = build_parser().parse_args([*command, *flag])
        assert not structured_outputs_config_from_args(args).disable_additional_properties
        plain = build_parser().parse_args(command)
        assert structured_outputs_config_from_args(plain) == StructuredOutputsConfig()
    # Each extra API server gets its options as JSON (api_servers): the option survives it.
    options = CoordinatorOptions(structured_outputs=StructuredOutputsConfig(False))
    decoded = msgspec.json.decode(msgspec.json.encode(options), type=CoordinatorOptions)
    assert decoded.structured_outputs == StructuredOutputsConfig(False)
