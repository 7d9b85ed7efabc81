"""vLLM's server-side chat-template flags through ``corefleet serve`` on the embedded SmolLM2:
``--chat-template FILE`` replaces the model's template for chat completions, Responses,
``/tokenize``'s chat form and ``/tokenizer_info``; ``--default-chat-template-kwargs`` lie under
each request's ``chat_template_kwargs``; ``reasoning_effort`` reaches the template. Each prompt
is checked against the same conversation rendered by hand and tokenized as plain text. One
server for the whole file."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.serve_support import running_serve

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
FLAGS = ("--dtype", "float32", "--kv-cache-memory", str(256 << 20))
QUESTION = "What is the capital of France?"
# The server's template: a system turn naming a persona (a template variable), the turns, and
# a thinking line that only enable_thinking opens, naming reasoning_effort.
TEMPLATE = (
    "{% if persona %}{{ '<|im_start|>system\nYou are ' + persona + '.<|im_end|>\n' }}{% endif %}"
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking %}{{ '<think effort=' + reasoning_effort + '>\n' }}{% endif %}"
    "{% endif %}"
)
DEFAULT_PERSONA = "a terse geographer"


def by_hand(persona: str | None = DEFAULT_PERSONA, effort: str | None = None) -> str:
    """TEMPLATE rendered by hand for one user turn asking QUESTION."""
    system = f"<|im_start|>system\nYou are {persona}.<|im_end|>\n" if persona else ""
    thinking = f"<think effort={effort}>\n" if effort else ""
    return f"{system}<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n{thinking}"


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    path = tmp_path_factory.mktemp("template") / "persona.jinja"
    path.write_text(TEMPLATE, encoding="utf-8")
    flags = ("--chat-template", str(path), "--enable-tokenizer-info-endpoint")
    defaults = ("--default-chat-template-kwargs", f'{{"persona": "{DEFAULT_PERSONA}"}}')
    with running_serve(*FLAGS, *flags, *defaults) as url:
        yield url


@pytest.fixture(scope="module")
def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="x", timeout=120, max_retries=0)


def text_tokens(base: str, text: str) -> list[int]:
    """``text``'s tokens as a plain prompt (no template, no special tokens added)."""
    body = {"model": MODEL, "prompt": text, "add_special_tokens": False}
    reply = httpx.post(f"{base}/tokenize", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    tokens: list[int] = reply.json()["tokens"]
    return tokens


def chat_tokens(base: str, **extra: Any) -> list[int]:
    """``/tokenize``'s chat form of one user turn asking QUESTION."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}], **extra}
    reply = httpx.post(f"{base}/tokenize", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    tokens: list[int] = reply.json()["tokens"]
    return tokens


def ask(client: openai.OpenAI, **extra: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=2,
        temperature=0.0,
        **extra,
    )


def test_chat_and_tokenize_render_with_the_server_template(
    base: str, client: openai.OpenAI
) -> None:
    expected = text_tokens(base, by_hand())
    answer = ask(client)
    assert answer.usage.prompt_tokens == len(expected)
    assert chat_tokens(base) == expected


def test_request_kwargs_override_the_server_defaults(base: str, client: openai.OpenAI) -> None:
    poet = {"chat_template_kwargs": {"persona": "a poet of many words"}}
    assert chat_tokens(base, **poet) == text_tokens(base, by_hand("a poet of many words"))
    answer = ask(client, extra_body=poet)
    assert answer.usage.prompt_tokens == len(text_tokens(base, by_hand("a poet of many words")))
    # null leaves the default in place (vLLM's merge); an empty persona removes the turn.
    assert chat_tokens(base, chat_template_kwargs={"persona": None}) == chat_tokens(base)
    empty = chat_tokens(base, chat_template_kwargs={"persona": ""})
    assert empty == text_tokens(base, by_hand(persona=None))


def test_reasoning_effort_reaches_the_template(base: str, client: openai.OpenAI) -> None:
    for effort in ("low", "high", "max"):
        answer = ask(client, reasoning_effort=effort)
        assert answer.usage.prompt_tokens == len(text_tokens(base, by_hand(effort=effort)))
    # none: enable_thinking false, no thinking line; the request's enable_thinking wins.
    assert ask(client, reasoning_effort="none").usage.prompt_tokens == len(
        text_tokens(base, by_hand())
    )
    off = ask(client, reasoning_effort="high", extra_body={"chat_template_kwargs": {}})
    assert off.usage.prompt_tokens == len(text_tokens(base, by_hand(effort="high")))
    kept_off = {"chat_template_kwargs": {"enable_thinking": False}}
    answer = ask(client, reasoning_effort="high", extra_body=kept_off)
    assert answer.usage.prompt_tokens == len(text_tokens(base, by_hand()))
    # Values vLLM does not know are a 400 naming the field; the server goes on serving.
    for bad in ("extreme", "x" * 100_000, 7):
        body = {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}]}
        reply = httpx.post(
            f"{base}/v1/chat/completions", json={**body, "reasoning_effort": bad}, timeout=60
        )
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == "reasoning_effort"
    assert ask(client).usage.prompt_tokens == len(text_tokens(base, by_hand()))


def test_responses_render_with_the_server_template(base: str, client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL, input=QUESTION, max_output_tokens=2, temperature=0.0
    )
    assert response.usage is not None
    assert response.usage.input_tokens == len(text_tokens(base, by_hand()))


def test_tokenizer_info_shows_the_server_template(base: str) -> None:
    info = httpx.get(f"{base}/tokenizer_info", timeout=30).json()
    assert info["chat_template"] == TEMPLATE
