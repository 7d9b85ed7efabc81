"""vLLM's server-side chat-template flags (``--chat-template``,
``--chat-template-content-format``, ``--default-chat-template-kwargs``) and the chat request's
``reasoning_effort``: how the flags are read and checked at start-up, and what the template is
given once they are merged with a request's own ``chat_template_kwargs``."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from corefleet.engine.cli import main, parse_args
from corefleet.engine.entrypoints.coordinator import CoordinatorOptions
from corefleet.engine.frontend.input_processor import InputProcessor
from corefleet.engine.frontend.tokenizer import Tokenizer
from corefleet.engine.openai.api_options import ApiOptions, api_options_from_args
from corefleet.engine.openai.chat_render import check_chat_template_fields, render_chat
from corefleet.engine.openai.chat_template_options import (
    MAX_DEFAULT_KWARGS,
    MAX_DEFAULT_KWARGS_CHARS,
    MAX_SERVER_TEMPLATE_BYTES,
    ChatTemplateOptions,
    load_chat_template,
    merge_template_kwargs,
    parse_default_kwargs,
)
from corefleet.engine.openai.errors import RequestError, parse_request
from corefleet.engine.openai.extra_fields import check_extra_fields
from corefleet.engine.openai.pooling_api import PoolingApi
from corefleet.engine.openai.pooling_protocol import PoolingRequest
from corefleet.engine.openai.protocol import ChatCompletionRequest, CompletionRequest
from corefleet.engine.openai.tokenize_api import TokenizeApi
from corefleet.engine.openai.tokenize_protocol import TokenizeChatRequest
from tests.fixtures_models import write_tiny_tokenizer

USER = {"role": "user", "content": "hi"}
# Shows what the template was given: the thinking switch, the effort and a default.
SHOW = (
    "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    "|think={{ enable_thinking }}|effort={{ reasoning_effort }}|tone={{ tone }}"
)
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok") / "tiny"
    write_tiny_tokenizer(path, add_bos_token=False)
    return Tokenizer.from_model_path(path).with_chat_template(SHOW)


def chat(**fields: Any) -> ChatCompletionRequest:
    return parse_request(ChatCompletionRequest, {"messages": [USER], **fields})


def shown(tok: Tokenizer, body: ChatCompletionRequest, defaults: Any = None) -> str:
    check_chat_template_fields(body, trust_request_template=False)
    return render_chat(tok, body.template_messages(), body, defaults=defaults)


# -- --chat-template ------------------------------------------------------------------------


def test_a_file_is_read_as_it_is(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    text = "{% for m in messages %}{{ m.content }}\\n{% endfor %}é"  # escapes stay in a file
    path.write_text(text, encoding="utf-8")
    assert load_chat_template(str(path)) == text


def test_an_inline_template_has_its_escapes_decoded_and_keeps_other_text() -> None:
    assert load_chat_template("{{ messages[0].content }}\\n") == "{{ messages[0].content }}\n"
    assert load_chat_template("Ünïcode → {{ x }}") == "Ünïcode → {{ x }}"
    assert load_chat_template("a\nb") == "a\nb"  # a real newline marks a template too


def test_a_path_that_does_not_exist_is_an_error_naming_the_flag(tmp_path: Path) -> None:
    for value in (str(tmp_path / "missing.jinja"), "template_chatml", str(tmp_path)):
        with pytest.raises(ValueError, match=r"--chat-template .*looks like a file path"):
            load_chat_template(value)


def test_a_file_too_large_or_not_utf8_is_an_error(tmp_path: Path) -> None:
    big = tmp_path / "big.jinja"
    big.write_bytes(b"x" * (MAX_SERVER_TEMPLATE_BYTES + 1))
    with pytest.raises(ValueError, match=r"--chat-template .*larger than"):
        load_chat_template(str(big))
    binary = tmp_path / "weights.bin"
    binary.write_bytes(b"\xff\xfe\x00{{")
    with pytest.raises(ValueError, match=r"--chat-template .*not UTF-8"):
        load_chat_template(str(binary))
    with pytest.raises(ValueError, match="--chat-template: a bad backslash escape"):
        load_chat_template("{{ x }}\\x")


def test_a_template_that_does_not_parse_fails_the_options() -> None:
    with pytest.raises(ValueError, match="--chat-template: the chat template does not parse"):
        ChatTemplateOptions(chat_template="{% if %}")
    with pytest.raises(ValueError, match="--chat-template: the template is longer"):
        ChatTemplateOptions(chat_template="x" * (MAX_SERVER_TEMPLATE_BYTES + 1))


def test_content_formats_auto_and_string_are_accepted_openai_is_refused() -> None:
    for fmt in ("auto", "string"):
        assert ChatTemplateOptions(chat_template_content_format=fmt)
    with pytest.raises(ValueError, match="openai is not supported"):
        ChatTemplateOptions(chat_template_content_format="openai")
    with pytest.raises(ValueError, match="must be one of"):
        ChatTemplateOptions(chat_template_content_format="x" * 10_000)


# -- --default-chat-template-kwargs -----------------------------------------------------------


def test_default_kwargs_must_be_a_bounded_json_object() -> None:
    assert parse_default_kwargs('{"enable_thinking": false}') == {"enable_thinking": False}
    assert parse_default_kwargs(None) == {}
    for bad in ("[1]", '"x"', "3", "null"):
        with pytest.raises(ValueError, match="--default-chat-template-kwargs must be a JSON obj"):
            parse_default_kwargs(bad)
    with pytest.raises(ValueError, match="--default-chat-template-kwargs is not valid JSON"):
        parse_default_kwargs("{enable_thinking: false}")
    with pytest.raises(ValueError, match="is longer than"):
        parse_default_kwargs(json.dumps({"x": "y" * MAX_DEFAULT_KWARGS_CHARS}))
    with pytest.raises(ValueError, match="is not valid JSON"):  # absurd nesting
        parse_default_kwargs('{"a": ' + "[" * (MAX_DEFAULT_KWARGS_CHARS - 8) + "}")
    many = json.dumps({f"k{i}": i for i in range(MAX_DEFAULT_KWARGS + 1)})
    with pytest.raises(ValueError, match="names; at most"):
        parse_default_kwargs(many)
    with pytest.raises(ValueError, match="'messages' cannot be set there"):
        parse_default_kwargs('{"messages": []}')


def test_the_request_wins_over_the_defaults_unless_null_or_auto() -> None:
    defaults = {"enable_thinking": False, "tone": "dry"}
    assert merge_template_kwargs(defaults, {}) == defaults
    assert merge_template_kwargs(defaults, {"enable_thinking": True, "x": 1}) == {
        "enable_thinking": True,
        "tone": "dry",
        "x": 1,
    }
    assert merge_template_kwargs(defaults, {"tone": None, "enable_thinking": "auto"}) == defaults
    assert merge_template_kwargs(None, {"tone": None}) == {"tone": None}  # no defaults: as sent


def test_defaults_reach_the_template_under_the_request(tiny: Tokenizer) -> None:
    defaults = {"tone": "dry", "enable_thinking": False}
    assert shown(tiny, chat(), defaults) == "[user]hi|think=False|effort=|tone=dry"
    body = chat(chat_template_kwargs={"tone": "warm"})
    assert shown(tiny, body, defaults) == "[user]hi|think=False|effort=|tone=warm"
    assert shown(tiny, chat(), None) == "[user]hi|think=|effort=|tone="


# -- reasoning_effort -------------------------------------------------------------------------


def test_reasoning_effort_reaches_the_template_and_switches_thinking(tiny: Tokenizer) -> None:
    for effort in EFFORTS:
        think = effort != "none"
        body = chat(reasoning_effort=effort)
        assert shown(tiny, body) == f"[user]hi|think={think}|effort={effort}|tone="
    # The request's own enable_thinking wins; the effort still reaches the template.
    body = chat(reasoning_effort="high", chat_template_kwargs={"enable_thinking": False})
    assert shown(tiny, body) == "[user]hi|think=False|effort=high|tone="
    # The field wins over a reasoning_effort in chat_template_kwargs (vLLM's merge).
    body = chat(reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "high"})
    assert shown(tiny, body) == "[user]hi|think=True|effort=low|tone="
    # A server default of enable_thinking false gives way to an asked effort (vLLM's order).
    assert shown(tiny, chat(reasoning_effort="medium"), {"enable_thinking": False}) == (
        "[user]hi|think=True|effort=medium|tone="
    )


def test_reasoning_effort_other_values_are_a_400_naming_the_field() -> None:
    for bad in ("extreme", "", "HIGH", 3, True, "x" * 100_000):
        with pytest.raises(RequestError) as info:
            chat(reasoning_effort=bad)
        assert info.value.status == 400
        assert info.value.param == "reasoning_effort"
    assert chat(reasoning_effort=None).reasoning_effort is None


def test_reasoning_effort_is_refused_on_completions() -> None:
    body = parse_request(CompletionRequest, {"prompt": "hi", "reasoning_effort": "low"})
    with pytest.raises(RequestError) as info:
        check_extra_fields(body.model_extra, "completions")
    assert info.value.param == "reasoning_effort"
    assert "reasoning_effort" in ChatCompletionRequest.model_fields


# -- the flags ------------------------------------------------------------------------------


def test_the_flags_become_the_server_options(tmp_path: Path) -> None:
    path = tmp_path / "custom.jinja"
    path.write_text(SHOW, encoding="utf-8")
    argv = ["serve", "--chat-template", str(path), "--chat-template-content-format", "string"]
    argv += ["--default-chat-template-kwargs", '{"tone": "dry"}']
    options = api_options_from_args(parse_args(argv)).chat
    assert options == ChatTemplateOptions(SHOW, "string", {"tone": "dry"})
    assert api_options_from_args(parse_args(["serve"])).chat == ChatTemplateOptions()
    # As serve --api-server-count hands them to its API processes: the text, not the path.
    coordinator = CoordinatorOptions(api=ApiOptions(chat=options))
    decoded = msgspec.json.decode(msgspec.json.encode(coordinator), type=CoordinatorOptions)
    assert decoded.api.chat == options


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--chat-template", "{% if %}"], "--chat-template: the chat template does not parse"),
        (["--chat-template", "no_such_template"], "--chat-template 'no_such_template' looks"),
        (["--default-chat-template-kwargs", "[]"], "--default-chat-template-kwargs must be"),
        (["--chat-template-content-format", "openai"], "--chat-template-content-format openai"),
    ],
)
def test_a_bad_flag_stops_serve_before_it_starts(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", *flags]) == 2
    assert message in capsys.readouterr().err


def test_the_server_template_replaces_the_models_on_a_copy(tmp_path: Path) -> None:
    write_tiny_tokenizer(tmp_path / "tok", add_bos_token=False)
    model = Tokenizer.from_model_path(tmp_path / "tok")
    served = model.with_chat_template(SHOW)
    assert served.chat_template == SHOW and model.chat_template != SHOW
    assert served.backend is model.backend
    assert served.apply_chat_template([USER]).startswith("[user]hi|think=")


def test_tokenize_and_pooling_chat_forms_use_the_server_defaults(tiny: Tokenizer) -> None:
    options = ApiOptions(chat=ChatTemplateOptions(default_chat_template_kwargs={"tone": "dry"}))
    state: Any = SimpleNamespace(tokenizer=tiny, options=options)
    expected = tiny.encode("[user]hi|think=|effort=|tone=dry", add_special_tokens=False)
    body = parse_request(TokenizeChatRequest, {"messages": [USER]})
    assert TokenizeApi(state)._chat_ids(body) == expected
    pooling = parse_request(PoolingRequest, {"messages": [USER]})
    inputs = InputProcessor(tiny, 4096, tiny.vocab_size)
    assert PoolingApi(state)._token_ids(pooling, inputs, check_length=True) == [expected]
    # The request's own kwargs win there too.
    tone = {"chat_template_kwargs": {"tone": "warm"}}
    warm = tiny.encode("[user]hi|think=|effort=|tone=warm", add_special_tokens=False)
    body = parse_request(TokenizeChatRequest, {"messages": [USER], **tone})
    assert TokenizeApi(state)._chat_ids(body) == warm
    pooling = parse_request(PoolingRequest, {"messages": [USER], **tone})
    assert PoolingApi(state)._token_ids(pooling, inputs, check_length=True) == [warm]
