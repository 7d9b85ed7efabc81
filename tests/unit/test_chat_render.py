"""vLLM's chat-template options: the request fields, their 400s and the one rendering that
``/v1/chat/completions`` (and ``/tokenize``) share, on a tiny tokenizer and against
transformers' ``apply_chat_template``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from corefleet.engine.frontend.tokenizer import ChatTemplateRefused, Tokenizer
from corefleet.engine.openai.chat_render import (
    MAX_CHAT_TEMPLATE_CHARS,
    MAX_CHAT_TEMPLATE_KWARGS,
    MAX_DOCUMENTS,
    MAX_ROLE_CHARS,
    UNTRUSTED_TEMPLATE,
    check_chat_template_fields,
    echoed_text,
    render_chat,
    render_chat_tokens,
    response_role,
)
from corefleet.engine.openai.errors import CHAT_TEMPLATE_REFUSED, RequestError, parse_request
from corefleet.engine.openai.extra_fields import check_extra_fields
from corefleet.engine.openai.protocol import ChatCompletionRequest
from tests.fixtures_models import BOS_TOKEN, EOS_TOKEN, write_tiny_tokenizer

USER = {"role": "user", "content": "What is 2 + 2?"}
PARTIAL = {"role": "assistant", "content": "The answer is "}
BOTH = "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
# Prints every message with its role, a kwarg and the documents: what the template was given.
SHOW = (
    "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    "|{{ greeting }}|{% for d in documents or [] %}<{{ d.title }}>{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tiny"
    write_tiny_tokenizer(path, add_bos_token=False)
    return path


@pytest.fixture(scope="module")
def tiny(folder: Path) -> Tokenizer:
    return Tokenizer.from_model_path(folder)


def request(**fields: Any) -> ChatCompletionRequest:
    body = {"messages": [USER], **fields}
    return parse_request(ChatCompletionRequest, body)


def render(tok: Tokenizer, body: ChatCompletionRequest, trusted: bool = True) -> str:
    check_chat_template_fields(body, trusted)
    return render_chat(tok, body.template_messages(), body)


def refusal(trusted: bool = True, **fields: Any) -> RequestError:
    with pytest.raises(RequestError) as info:
        check_chat_template_fields(request(**fields), trusted)
    assert info.value.status == 400
    return info.value


# -- rendering ------------------------------------------------------------------------------


def test_defaults_render_as_before(tiny: Tokenizer) -> None:
    body = request()
    assert render(tiny, body) == tiny.apply_chat_template([USER], add_generation_prompt=True)
    text, ids = render_chat_tokens(tiny, body.template_messages(), body)
    assert ids == tiny.encode(text, add_special_tokens=False)  # add_special_tokens: false


def test_request_template_sees_kwargs_documents_and_custom_roles(tiny: Tokenizer) -> None:
    messages = [{"role": "narrator", "content": "Once"}, USER]
    body = request(
        messages=messages,
        chat_template=SHOW,
        chat_template_kwargs={"greeting": "hola"},
        documents=[{"title": "doc1", "text": "x"}, {"title": "doc2", "text": "y"}],
    )
    assert render(tiny, body) == ("[narrator]Once[user]What is 2 + 2?|hola|<doc1><doc2>[assistant]")


def test_kwargs_cannot_override_the_request_fields(tiny: Tokenizer) -> None:
    # vLLM's merge: add_generation_prompt and continue_final_message come from the request;
    # documents from the request when it has them, else from the kwargs.
    kwargs = {"add_generation_prompt": False, "greeting": "x", "documents": [{"title": "k"}]}
    text = render(tiny, request(chat_template=SHOW, chat_template_kwargs=kwargs))
    assert text.endswith("|x|<k>[assistant]")
    both = request(chat_template=SHOW, chat_template_kwargs=kwargs, documents=[{"title": "r"}])
    assert render(tiny, both).endswith("|x|<r>[assistant]")


def test_kwargs_override_special_tokens_of_the_model_template(tiny: Tokenizer) -> None:
    text = render(tiny, request(chat_template_kwargs={"bos_token": "<<B>>"}))
    assert text.startswith("<<B>>") and BOS_TOKEN not in text


def test_add_generation_prompt_false(tiny: Tokenizer) -> None:
    text = render(tiny, request(add_generation_prompt=False))
    assert text.endswith(f"What is 2 + 2?{EOS_TOKEN}\n")


def test_continue_final_message_leaves_the_last_message_open(tiny: Tokenizer) -> None:
    body = request(
        messages=[USER, PARTIAL], add_generation_prompt=False, continue_final_message=True
    )
    text = render(tiny, body)
    # The tiny template trims content: the text ends with the stripped message, no end of turn.
    assert text.endswith("<|im_start|>assistant\nThe answer is")
    closed = render(tiny, request(messages=[USER, PARTIAL], add_generation_prompt=False))
    assert closed == f"{text}{EOS_TOKEN}\n"


@pytest.mark.parametrize(
    "final",
    ["The answer is ", "The answer is", "  4", "", "line one\nline two\n"],
)
def test_continue_final_message_matches_transformers(
    tiny: Tokenizer, folder: Path, final: str
) -> None:
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(folder)
    conversation = [USER, {"role": "assistant", "content": final}]
    body = request(messages=conversation, add_generation_prompt=False, continue_final_message=True)
    expected = theirs.apply_chat_template(
        conversation, continue_final_message=True, add_generation_prompt=False, tokenize=False
    )
    assert render(tiny, body) == expected


def test_continue_final_message_needs_the_message_in_the_text(tiny: Tokenizer) -> None:
    dropping = "{% for m in messages[:-1] %}{{ m.content }}{% endfor %}"
    body = request(
        messages=[USER, PARTIAL],
        add_generation_prompt=False,
        continue_final_message=True,
        chat_template=dropping,
    )
    with pytest.raises(ChatTemplateRefused, match="final message does not appear"):
        render(tiny, body)


def test_add_special_tokens_adds_bos(tmp_path: Path) -> None:
    write_tiny_tokenizer(tmp_path, add_bos_token=True)
    tok = Tokenizer.from_model_path(tmp_path)
    plain = request()
    with_bos = request(add_special_tokens=True)
    _, ids = render_chat_tokens(tok, plain.template_messages(), plain)
    assert render_chat_tokens(tok, with_bos.template_messages(), with_bos)[1] == [0, *ids]


def test_template_errors_on_kwargs_are_the_requests(tiny: Tokenizer) -> None:
    # A value the template cannot use (a TypeError inside it) is a 400, as at vLLM, not a 500.
    body = request(chat_template="{{ count + 1 }}", chat_template_kwargs={"count": "a"})
    with pytest.raises(ChatTemplateRefused, match="failed on this request"):
        render(tiny, body)


def test_a_request_template_leaving_the_sandbox_is_a_400(tiny: Tokenizer) -> None:
    body = request(chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(RequestError) as info:
        render(tiny, body)
    assert (info.value.param, info.value.code) == ("chat_template", CHAT_TEMPLATE_REFUSED)


def test_custom_role_reaches_the_model_template(tiny: Tokenizer) -> None:
    # The tiny template knows three roles and refuses the rest itself (a 400 at the API).
    with pytest.raises(ChatTemplateRefused, match="unknown role: narrator"):
        render(tiny, request(messages=[{"role": "narrator", "content": "x"}]))


# -- the 400s -------------------------------------------------------------------------------


def test_both_prompt_flags_are_refused() -> None:
    err = refusal(add_generation_prompt=True, continue_final_message=True)
    assert (str(err.message), err.param) == (BOTH, "continue_final_message")
    # add_generation_prompt defaults to true: continuing alone is refused too (vLLM fails it).
    assert refusal(continue_final_message=True).message == BOTH
    check_chat_template_fields(
        request(add_generation_prompt=False, continue_final_message=True), False
    )


def test_request_templates_need_trust() -> None:
    err = refusal(trusted=False, chat_template="{{ messages }}")
    assert (err.message, err.param, err.code) == (
        UNTRUSTED_TEMPLATE,
        "chat_template",
        CHAT_TEMPLATE_REFUSED,
    )


def test_a_template_that_does_not_parse() -> None:
    err = refusal(chat_template="{% for m in %}")
    assert (err.param, err.code) == ("chat_template", CHAT_TEMPLATE_REFUSED)
    assert "does not parse" in err.message


@pytest.mark.parametrize("name", ["messages", "tools", "chat_template", "tokenize", "conversation"])
def test_reserved_kwargs(name: str) -> None:
    err = refusal(chat_template_kwargs={name: []})
    assert err.param == "chat_template_kwargs" and repr(name) in err.message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("chat_template", "x" * (MAX_CHAT_TEMPLATE_CHARS + 1)),
        ("chat_template", "x" * 10_000_000),
        ("chat_template_kwargs", {f"k{i}": i for i in range(MAX_CHAT_TEMPLATE_KWARGS + 1)}),
        ("chat_template_kwargs", {f"k{i}": i for i in range(1_000_000)}),
        ("documents", [{"title": "t"}] * (MAX_DOCUMENTS + 1)),
        ("documents", [{"title": "t"}] * 1_000_000),
        ("documents", [{"title": 5}]),
        ("chat_template_kwargs", ["not", "a", "map"]),
        ("add_generation_prompt", "yes"),
        ("echo", 1),
    ],
)
def test_bounds_and_types(field: str, value: Any) -> None:
    with pytest.raises(RequestError) as info:
        request(**{field: value})
    assert info.value.param == field


@pytest.mark.parametrize("role", ["", "r" * (MAX_ROLE_CHARS + 1), "r" * 1_000_000, 5])
def test_role_bounds(role: Any) -> None:
    with pytest.raises(RequestError) as info:
        request(messages=[{"role": role, "content": "x"}])
    assert info.value.param == "messages"


def test_the_fields_are_declared_not_refused() -> None:
    body = request(
        add_generation_prompt=False,
        continue_final_message=True,
        add_special_tokens=True,
        chat_template="{{ messages }}",
        chat_template_kwargs={"enable_thinking": False},
        documents=[{"title": "t", "text": "x"}],
        echo=True,
    )
    assert not body.model_extra
    check_extra_fields(body.model_extra, "chat")


# -- echo and the answer's role --------------------------------------------------------------


def test_echo_and_response_role() -> None:
    continued = request(
        messages=[USER, PARTIAL], add_generation_prompt=False, continue_final_message=True
    )
    assert response_role(continued) == "assistant" and echoed_text(continued) == ""
    echoed = continued.model_copy(update={"echo": True})
    assert echoed_text(echoed) == PARTIAL["content"]
    # A new assistant turn after a user message: the last message is not the answer's role.
    assert echoed_text(request(echo=True)) == ""
    # Without a generation prompt the answer goes on in the last message's role (vLLM's).
    own = request(echo=True, add_generation_prompt=False)
    assert (response_role(own), echoed_text(own)) == ("user", USER["content"])
