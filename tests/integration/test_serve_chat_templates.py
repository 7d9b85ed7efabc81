"""vLLM's chat-template options through ``corefleet serve`` on the embedded SmolLM2, with the
official client (``extra_body``) and raw HTTP: ``continue_final_message`` continues a partial
answer, ``echo`` prepends it, ``chat_template``/``chat_template_kwargs`` change the prompt, any
role reaches the template. One server (trusting request templates) for the whole file."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.serve_support import running_serve

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
FLAGS = ("--dtype", "float32", "--kv-cache-memory", str(256 << 20))
QUESTION = {"role": "user", "content": "What is the capital of France?"}
PARTIAL = {"role": "assistant", "content": "The capital of France is"}
SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
# SmolLM2's template, by hand: what the continued conversation must render to.
CONTINUED_PROMPT = (
    f"{SYSTEM}<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\nThe capital of France is"
)
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}
GREEDY: dict[str, Any] = {"max_tokens": 8, "temperature": 0.0}
# A request template that shows a kwarg and the documents to the model.
TEMPLATE = (
    "{% if verbose %}Answer in detail, with examples.\n{% endif %}"
    "{% for d in documents or [] %}Document: {{ d.text }}\n{% endfor %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    with running_serve(*FLAGS, "--trust-request-chat-template") as url:
        yield url


@pytest.fixture(scope="module")
def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="x", timeout=120, max_retries=0)


def chat(client: openai.OpenAI, messages: list[dict[str, str]], **extra: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        extra_body=extra,
        **GREEDY,
    )


def test_continue_final_message_continues_the_partial_answer(client: openai.OpenAI) -> None:
    continued = chat(client, [QUESTION, PARTIAL], **CONTINUE)
    text = continued.choices[0].message.content
    assert continued.choices[0].message.role == "assistant"
    assert "Paris" in text and not text.lstrip().startswith("The capital")
    # The same prompt as a plain completion: the same tokens, the same greedy answer.
    plain = client.completions.create(model=MODEL, prompt=CONTINUED_PROMPT, **GREEDY)
    assert continued.usage.prompt_tokens == plain.usage.prompt_tokens
    assert text == plain.choices[0].text
    # A new turn instead: the partial answer is closed, and the assistant's header follows.
    closed = chat(client, [QUESTION, PARTIAL])
    assert closed.usage.prompt_tokens > continued.usage.prompt_tokens


def test_echo_prepends_the_continued_message(client: openai.OpenAI, base: str) -> None:
    answer = chat(client, [QUESTION, PARTIAL], **CONTINUE).choices[0].message.content
    echoed = chat(client, [QUESTION, PARTIAL], echo=True, **CONTINUE)
    assert echoed.choices[0].message.content == PARTIAL["content"] + answer
    # Streamed (raw SSE): the role, then the echoed message in a piece of its own.
    body = {"model": MODEL, "messages": [QUESTION, PARTIAL], "stream": True, "echo": True}
    deltas = sse_deltas(base, body | CONTINUE | GREEDY)
    assert deltas[0] == {"role": "assistant", "content": PARTIAL["content"]}
    assert "".join(d.get("content") or "" for d in deltas) == PARTIAL["content"] + answer
    # With logprobs, echo also returns the prompt's (vLLM's), top_logprobs of them per token.
    with_logprobs = chat(
        client, [QUESTION, PARTIAL], echo=True, logprobs=True, top_logprobs=2, **CONTINUE
    )
    prompt_logprobs = with_logprobs.model_extra["prompt_logprobs"]
    assert len(prompt_logprobs) == with_logprobs.usage.prompt_tokens
    assert prompt_logprobs[0] is None and all(2 <= len(p) <= 3 for p in prompt_logprobs[1:])
    # After a user message a new assistant turn starts: nothing of the question is echoed.
    fresh = chat(client, [QUESTION], echo=True).choices[0].message.content
    assert fresh == chat(client, [QUESTION]).choices[0].message.content


def test_chat_template_kwargs_and_documents_change_the_prompt(client: openai.OpenAI) -> None:
    def prompt_tokens(**extra: Any) -> int:
        return int(chat(client, [QUESTION], chat_template=TEMPLATE, **extra).usage.prompt_tokens)

    terse = prompt_tokens()
    assert prompt_tokens(chat_template_kwargs={"verbose": False}) == terse
    verbose = prompt_tokens(chat_template_kwargs={"verbose": True})
    assert verbose > terse
    with_doc = prompt_tokens(documents=[{"title": "t", "text": "Paris is in France."}])
    assert with_doc > terse
    # The model's own template reads no kwargs: they change nothing there.
    own = chat(client, [QUESTION]).usage.prompt_tokens
    ignored = chat(client, [QUESTION], chat_template_kwargs={"verbose": True})
    assert ignored.usage.prompt_tokens == own


def test_custom_roles_reach_the_template(client: openai.OpenAI) -> None:
    narrator = {"role": "narrator", "content": "The story begins in Paris."}
    answer = chat(client, [narrator, QUESTION])
    expected = (
        f"{SYSTEM}<|im_end|>\n<|im_start|>narrator\nThe story begins in Paris.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    plain = client.completions.create(model=MODEL, prompt=expected, **GREEDY)
    assert answer.usage.prompt_tokens == plain.usage.prompt_tokens
    assert answer.choices[0].message.content == plain.choices[0].text


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"continue_final_message": True}, "continue_final_message", "Cannot set both"),
        (
            {"continue_final_message": True, "add_generation_prompt": True},
            "continue_final_message",
            "Cannot set both",
        ),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "'messages'"),
        ({"chat_template": "{% for m in %}"}, "chat_template", "does not parse"),
        ({"chat_template": "x" * 1_000_000}, "chat_template", "at most"),
        ({"chat_template_kwargs": {"n": {"a": 1}}, "chat_template": "{{ n + 1 }}"}, "messages", ""),
    ],
)
def test_bad_template_options_are_400s(
    base: str, extra: dict[str, Any], param: str, words: str
) -> None:
    body = {"model": MODEL, "messages": [QUESTION, PARTIAL], **GREEDY, **extra}
    reply = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and words in error["message"]
    # The server still answers.
    fixed = body | CONTINUE | {"chat_template": None, "chat_template_kwargs": None}
    ok = httpx.post(f"{base}/v1/chat/completions", json=fixed, timeout=60)
    assert ok.status_code == 200, ok.text


def test_an_absurd_role_is_a_400(base: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "r" * 100_000, "content": "hi"}], **GREEDY}
    reply = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages"


def sse_deltas(base: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``delta`` objects of a streamed chat answer (one choice), read as raw SSE."""
    deltas = []
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line.removeprefix("data: "))
                deltas += [c["delta"] for c in chunk["choices"]]
    return deltas
