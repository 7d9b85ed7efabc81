"""Fields a request does not declare (``engine/openai/extra_fields.py``): those that would change
the answer are refused with a 400 naming them, unless their value changes nothing; every other
is ignored and named in the log, in bounded space."""

from __future__ import annotations

import logging

import pytest

from corefleet.engine.openai import protocol as p
from corefleet.engine.openai.errors import RequestError, parse_request
from corefleet.engine.openai.extra_fields import REFUSED, check_extra_fields
from corefleet.engine.openai.responses_models import ResponsesRequest

COMPLETION = {"model": "m", "prompt": "x"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _extra(body: dict[str, object], chat: bool = False) -> dict[str, object] | None:
    model = p.ChatCompletionRequest if chat else p.CompletionRequest
    return parse_request(model, body).model_extra


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tool_choice", "required"),
        ("tool_choice", {"type": "function", "function": {"name": "f"}}),
        ("vllm_xargs", {"x": 1}),
        ("watermarking", True),
        ("thinking_token_budget", 100),
        ("repetition_detection", {"max_pattern_size": 4}),
        ("kv_transfer_params", {"do_remote_prefill": True}),
        ("logits_processors", ["x"]),
        ("modalities", ["text", "audio"]),
        ("add_special_tokens", False),
    ],
)
def test_a_field_that_changes_the_answer_is_a_400_naming_it(field: str, value: object) -> None:
    with pytest.raises(RequestError) as err:
        check_extra_fields(_extra({**COMPLETION, field: value}), "completions")
    assert err.value.status == 400 and err.value.param == field
    assert "not supported" in err.value.message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tool_choice", "none"),
        ("tool_choice", "auto"),
        ("vllm_xargs", {}),
        ("watermarking", False),
        ("thinking_token_budget", -1),
        ("kv_transfer_params", {}),
        ("logits_processors", []),
        ("modalities", ["text"]),
        ("add_special_tokens", True),
    ],
)
def test_a_value_that_changes_nothing_passes(field: str, value: object) -> None:
    check_extra_fields(_extra({**COMPLETION, field: value}), "completions")


def test_the_chat_template_fields_are_declared_not_extra() -> None:
    # vLLM's chat-template fields are implemented (chat_render.py): declared, never refused.
    for field, value in (
        ("add_generation_prompt", False),
        ("continue_final_message", True),
        ("chat_template", "{{ messages }}"),
        ("chat_template_kwargs", {"enable_thinking": True}),
        ("documents", [{"title": "t"}]),
        ("add_special_tokens", True),
        ("echo", True),
    ):
        assert not _extra({**CHAT, field: value}, chat=True)
        assert field not in REFUSED["chat"]


def test_a_true_is_not_taken_for_a_one() -> None:
    # JSON's 1 and true differ; a harmless false must not let 0 through as false.
    with pytest.raises(RequestError):
        check_extra_fields({"background": 0}, "responses")
    check_extra_fields({"background": False}, "responses")


def test_unknown_fields_are_ignored_and_named_in_bounded_space(
    caplog: pytest.LogCaptureFixture,
) -> None:
    names = {f"field_{i}_" + "x" * 10_000: i for i in range(5_000)}
    with caplog.at_level(logging.WARNING, logger="corefleet.engine.openai.extra_fields"):
        check_extra_fields(_extra({**COMPLETION, "user_tag": 1, **names}), "completions")
    (record,) = caplog.records
    message = record.getMessage()
    assert "'user_tag'" in message and "and 4985 more" in message
    assert len(message) < 2_000


def test_declared_fields_are_not_extra() -> None:
    assert _extra({**COMPLETION, "temperature": 0.5, "top_k": 3}) == {}


def test_every_refused_field_is_one_no_request_model_declares() -> None:
    declared = {
        "completions": set(p.CompletionRequest.model_fields),
        "chat": set(p.ChatCompletionRequest.model_fields),
        "responses": set(ResponsesRequest.model_fields),
    }
    for endpoint, rules in REFUSED.items():
        assert not declared[endpoint] & set(rules), endpoint


def test_known_fields_that_change_nothing_pass_without_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    body = {**COMPLETION, "metadata": {"k": "v"}, "store": False, "guided_decoding_backend": "x"}
    body |= {"session_id": "s", "stream_interval": 4, "spaces_between_special_tokens": False}
    with caplog.at_level(logging.WARNING, logger="corefleet.engine.openai.extra_fields"):
        check_extra_fields(_extra(body), "completions")
    assert not caplog.records
