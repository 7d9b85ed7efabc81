"""OpenAI requests: validation, conversion to SamplingParams, and the error bodies."""

from __future__ import annotations

import json
from typing import Any

import pytest

from corefleet.engine.openai.errors import (
    ErrorResponse,
    RequestError,
    error_from_json,
    parse_request,
)
from corefleet.engine.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
)
from corefleet.engine.openai.sampling_request import to_sampling_params
from tests.unit.openai_helpers import CHAT, COMPLETION, refused


def chat(**fields: Any) -> Any:
    return to_sampling_params(parse_request(ChatCompletionRequest, {**CHAT, **fields}))


def completion(**fields: Any) -> Any:
    return to_sampling_params(parse_request(CompletionRequest, {**COMPLETION, **fields}))


# -- requests -------------------------------------------------------------------------------


def test_completion_fields_land_under_vllm_names() -> None:
    params = completion(
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        n=2,
        stop="END",
        seed=3,
        logprobs=5,
        presence_penalty=0.1,
        frequency_penalty=-0.2,
        top_k=40,
        min_p=0.05,
        repetition_penalty=1.1,
        ignore_eos=True,
        min_tokens=2,
        stop_token_ids=[7, 8],
        user="u",
        stream=True,
        stream_options={"include_usage": True},
    )
    assert (params.max_tokens, params.temperature, params.top_p, params.n) == (7, 0.5, 0.9, 2)
    assert params.stop == ["END"]  # a single string becomes a list
    assert (params.seed, params.logprobs, params.top_k, params.min_p) == (3, 5, 40, 0.05)
    assert (params.presence_penalty, params.frequency_penalty) == (0.1, -0.2)
    assert (params.repetition_penalty, params.ignore_eos, params.min_tokens) == (1.1, True, 2)
    assert params.stop_token_ids == [7, 8]


def test_defaults_and_nulls_follow_openai_and_vllm() -> None:
    params = completion()
    assert (params.max_tokens, params.temperature, params.top_p, params.n) == (16, 1.0, 1.0, 1)
    assert params.logprobs is None and params.stop == []
    assert completion(max_tokens=None).max_tokens is None  # null: up to the context
    assert chat().max_tokens is None  # chat has no 16-token default
    # Explicit nulls (some clients send them) mean "the default".
    nulls = chat(temperature=None, top_p=None, n=None, stop=None, seed=None, top_k=None)
    assert (nulls.temperature, nulls.top_p, nulls.n, nulls.stop, nulls.top_k) == (
        1.0,
        1.0,
        1,
        [],
        0,
    )


def test_chat_max_tokens_and_logprobs_mapping() -> None:
    assert chat(max_tokens=5).max_tokens == 5
    assert chat(max_tokens=5, max_completion_tokens=9).max_tokens == 9
    assert chat(stop=["a", "b"]).stop == ["a", "b"]
    assert chat().logprobs is None
    assert chat(logprobs=True).logprobs == 0  # the sampled token only
    assert chat(logprobs=True, top_logprobs=4).logprobs == 4
    assert chat(logprobs=False).logprobs is None


def test_echo_and_prompt_logprobs_mapping() -> None:
    # As vLLM: echo's prompt gets logprobs like the answer, unless prompt_logprobs says.
    assert completion(echo=True, logprobs=3).prompt_logprobs == 3
    assert completion(echo=True, logprobs=3, prompt_logprobs=1).prompt_logprobs == 1
    assert completion(echo=True).prompt_logprobs is None
    assert completion(logprobs=3).prompt_logprobs is None  # no echo: no prompt scoring
    assert chat(prompt_logprobs=5).prompt_logprobs == 5
    # max_tokens 0 with echo: the engine runs one token, which the answer drops.
    assert completion(echo=True, max_tokens=0).max_tokens == 1
    # A stream carries no prompt_logprobs: 0 (asking for none) is accepted and computes none.
    assert completion(prompt_logprobs=0, stream=True).prompt_logprobs is None
    assert completion(echo=True, logprobs=2, stream=True).prompt_logprobs == 2


def test_unknown_fields_are_set_aside_but_known_fields_are_strict() -> None:
    # Set aside for extra_fields.check_extra_fields (test_extra_fields.py), never validated.
    request = parse_request(ChatCompletionRequest, {**CHAT, "metadata": {"x": 1}, "foo": 2})
    assert request.model_extra == {"metadata": {"x": 1}, "foo": 2}
    assert refused(ChatCompletionRequest, {**CHAT, "temperature": "0.5"}).param == "temperature"
    assert refused(ChatCompletionRequest, {**CHAT, "stream": 1}).param == "stream"
    assert refused(CompletionRequest, {**COMPLETION, "max_tokens": "16"}).param == "max_tokens"
    assert chat(temperature=1).temperature == 1.0  # an int is a fine float


def test_messages_are_rendered_for_the_template() -> None:
    request = parse_request(
        ChatCompletionRequest,
        {
            "messages": [
                {"role": "developer", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "assistant", "content": None},
            ]
        },
    )
    assert request.model is None
    assert request.template_messages() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": ""},
    ]


@pytest.mark.parametrize(
    ("prompt", "inputs"),
    [
        ("hi", ["hi"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2], [{"prompt_token_ids": [1, 2]}]),
        ([[1], [2, 3]], [{"prompt_token_ids": [1]}, {"prompt_token_ids": [2, 3]}]),
    ],
)
def test_completion_prompt_forms(prompt: Any, inputs: list[Any]) -> None:
    request = parse_request(CompletionRequest, {"prompt": prompt})
    assert request.prompt_inputs() == inputs


@pytest.mark.parametrize(
    ("kind", "body", "param"),
    [
        (ChatCompletionRequest, {"model": "m"}, "messages"),
        (ChatCompletionRequest, {"model": "m", "messages": "hi"}, "messages"),
        (ChatCompletionRequest, {"model": "m", "messages": []}, "messages"),
        (ChatCompletionRequest, {**CHAT, "max_tokens": 0}, "max_tokens"),
        (ChatCompletionRequest, {**CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
        (ChatCompletionRequest, {**CHAT, "temperature": -1}, "temperature"),
        (ChatCompletionRequest, {**CHAT, "top_p": 0}, "top_p"),
        (ChatCompletionRequest, {**CHAT, "n": 0}, "n"),
        (ChatCompletionRequest, {**CHAT, "stop": ""}, "stop"),
        (ChatCompletionRequest, {**CHAT, "stop": ["ok", ""]}, "stop"),
        (ChatCompletionRequest, {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (ChatCompletionRequest, {**CHAT, "top_logprobs": 2}, "top_logprobs"),
        (
            ChatCompletionRequest,
            {**CHAT, "stream_options": {"include_usage": True}},
            "stream_options",
        ),
        (ChatCompletionRequest, {**CHAT, "tools": [{"type": "function"}]}, "tools"),
        (
            ChatCompletionRequest,
            {**CHAT, "response_format": {"type": "xml"}},
            "response_format",
        ),
        (CompletionRequest, {**COMPLETION, "guided_regex": 5}, "guided_regex"),
        (ChatCompletionRequest, {**CHAT, "logit_bias": {"one": 5.0}}, "logit_bias"),
        (ChatCompletionRequest, {"messages": [{"role": "", "content": "x"}]}, "messages"),
        (ChatCompletionRequest, {"messages": [{"role": "user"}]}, "messages"),
        (CompletionRequest, {**COMPLETION, "max_tokens": 0}, "max_tokens"),
        (CompletionRequest, {**COMPLETION, "logprobs": 21}, "logprobs"),
        (CompletionRequest, {**COMPLETION, "logprobs": -1}, "logprobs"),
        (CompletionRequest, {**COMPLETION, "max_tokens": 0, "echo": False}, "max_tokens"),
        (CompletionRequest, {**COMPLETION, "prompt_logprobs": 21}, "prompt_logprobs"),
        (CompletionRequest, {**COMPLETION, "prompt_logprobs": 10**12}, "prompt_logprobs"),
        (CompletionRequest, {**COMPLETION, "prompt_logprobs": -1}, "prompt_logprobs"),
        (
            CompletionRequest,
            {**COMPLETION, "prompt_logprobs": 1, "stream": True},
            "prompt_logprobs",
        ),
        (ChatCompletionRequest, {**CHAT, "prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
        (CompletionRequest, {**COMPLETION, "suffix": "x"}, "suffix"),
        (CompletionRequest, {**COMPLETION, "best_of": 3}, "best_of"),
        (CompletionRequest, {**COMPLETION, "presence_penalty": 3}, "presence_penalty"),
        (CompletionRequest, {"prompt": []}, "prompt"),
        (CompletionRequest, {"prompt": [1, "a"]}, "prompt"),
        (CompletionRequest, {"prompt": [[1], []]}, "prompt"),
        (CompletionRequest, {"model": "m"}, "prompt"),
    ],
)
def test_invalid_requests_name_the_field(kind: type, body: dict[str, Any], param: str) -> None:
    assert refused(kind, body).param == param


def test_unsupported_content_part_gets_one_clear_message() -> None:
    image = {"type": "image_url", "image_url": {"url": "http://x"}}
    error = refused(ChatCompletionRequest, {"messages": [{"role": "user", "content": [image]}]})
    assert error.param == "messages"
    assert "messages[0].content" in error.message and "'image_url'" in error.message


def test_range_errors_mention_the_request_field() -> None:
    error = refused(ChatCompletionRequest, {**CHAT, "max_completion_tokens": 0})
    assert error.param == "max_completion_tokens" and "greater than or equal to 1" in error.message
    error = refused(ChatCompletionRequest, {**CHAT, "logprobs": True, "top_logprobs": 21})
    assert error.param == "top_logprobs"
    assert "echo" in refused(CompletionRequest, {**COMPLETION, "max_tokens": 0}).message


def test_malformed_bodies() -> None:
    for body in ("{not json", "", b"\xff"):
        error = refused(CompletionRequest, body)
        assert error.param is None and "not valid JSON" in error.message
    error = refused(CompletionRequest, "[1, 2]")
    assert error.param is None and "JSON object" in error.message
    assert parse_request(CompletionRequest, json.dumps(COMPLETION).encode()).prompt == "hi"


# -- errors ---------------------------------------------------------------------------------


def test_error_body_shape_is_openais() -> None:
    body = json.loads(
        refused(ChatCompletionRequest, {"model": "m"}).to_response().model_dump_json()
    )
    assert list(body) == ["error"]
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str)
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["param"] == "messages" and body["error"]["code"] is None
    no_param = json.loads(error_from_json("boom").to_response().model_dump_json())
    assert set(no_param["error"]) == {"message", "type", "param", "code"}
    assert no_param["error"]["param"] is None
    assert RequestError("x", status=503).type == "server_error"


def test_error_response_model_parses_its_own_body() -> None:
    body = RequestError("x", param="stop").to_response().model_dump_json()
    assert ErrorResponse.model_validate_json(body).error.param == "stop"
