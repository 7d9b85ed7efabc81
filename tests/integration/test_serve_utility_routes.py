"""vLLM's routes beside generation, through ``corefleet serve`` on the embedded SmolLM2: the
model card (``models.list``/``models.retrieve``), ``/tokenize`` (both forms), ``/detokenize``,
``/tokenizer_info``, ``/version``, ``/load``, and all of it behind ``--root-path`` with an API
key. One server for the whole file."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from importlib import metadata
from typing import Any

import httpx
import openai
import pytest

from corefleet.engine.frontend.tokenizer import Tokenizer
from corefleet.engine.models.default_model import default_model_path
from corefleet.engine.openai.tokenize_protocol import MAX_DETOKENIZE_TOKENS
from tests.serve_support import running_serve

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
KEY = "utility-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ROOT = "/llm"
FLAGS = (
    *("--dtype", "float32", "--kv-cache-memory", str(256 << 20)),
    *("--api-key", KEY, "--root-path", ROOT),
    *("--enable-tokenizer-info-endpoint", "--enable-server-load-tracking"),
)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    with running_serve(*FLAGS) as url:
        yield url


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_model_path(default_model_path())


def post(base: str, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    return httpx.post(f"{base}{path}", json=body, headers=AUTH, timeout=120, **kwargs)


def _status_of_declared_body(base: str, path: str, length: int) -> int:
    """The status answered to a POST whose head declares ``length`` bytes, before any is sent."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
        )
        sock.sendall(head.encode())
        reply = b""
        while b"\r\n" not in reply:
            chunk = sock.recv(4096)
            assert chunk, "the server closed the connection without an answer"
            reply += chunk
    return int(reply.split(b" ", 2)[1])


def test_the_model_card_is_vllms(base: str) -> None:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, timeout=120, max_retries=0)
    (card,) = client.models.list()
    extra = card.model_extra or {}
    assert (card.id, card.object, card.owned_by) == (MODEL, "model", "vllm")
    assert extra["root"] == default_model_path() and extra["parent"] is None
    assert isinstance(extra["max_model_len"], int) and extra["max_model_len"] > 0
    (permission,) = extra["permission"]
    assert permission["object"] == "model_permission" and permission["id"].startswith("modelperm-")
    retrieved = client.models.retrieve(MODEL)
    assert (retrieved.id, (retrieved.model_extra or {})["root"]) == (MODEL, extra["root"])
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4o")
    assert info.value.code == "model_not_found"


def test_tokenize_a_prompt(base: str, tokenizer: Tokenizer) -> None:
    text = "The capital of France is Paris."
    answer = post(base, "/tokenize", {"model": MODEL, "prompt": text, "return_token_strs": True})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["tokens"] == tokenizer.encode(text) and body["count"] == len(body["tokens"])
    assert body["token_strs"] == [tokenizer.backend.id_to_token(i) for i in body["tokens"]]
    assert "".join(body["token_strs"]).replace("Ġ", " ") == text
    plain = post(base, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert plain["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert plain["token_strs"] is None and plain["max_model_len"] == body["max_model_len"]
    # Longer than the context is still tokenized (vLLM's rule): the client compares the count.
    long = post(base, "/tokenize", {"prompt": "word " * 20000}).json()
    assert long["count"] > long["max_model_len"]


def test_the_chat_form_counts_what_the_chat_endpoint_sends(base: str) -> None:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, timeout=120, max_retries=0)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,  # type: ignore[arg-type]
        max_tokens=1,
    )
    assert chat.usage is not None
    tokenized = post(base, "/tokenize", {"messages": QUESTION}).json()
    assert tokenized["count"] == chat.usage.prompt_tokens
    # Without the assistant's opening, the prompt is shorter by exactly that opening.
    closed = post(base, "/tokenize", {"messages": QUESTION, "add_generation_prompt": False})
    assert 0 < closed.json()["count"] < tokenized["count"]
    assert tokenized["tokens"][: closed.json()["count"]] == closed.json()["tokens"]
    # continue_final_message leaves the last (assistant) turn open: its text ends the prompt.
    partial = [*QUESTION, {"role": "assistant", "content": "The capital is"}]
    opened = post(
        base,
        "/tokenize",
        {"messages": partial, "add_generation_prompt": False, "continue_final_message": True},
    ).json()
    text = httpx.post(
        f"{base}/detokenize", json={"tokens": opened["tokens"]}, headers=AUTH, timeout=60
    ).json()["prompt"]
    assert text.endswith("The capital is")
    both = post(
        base, "/tokenize", {"messages": partial, "continue_final_message": True}
    )  # add_generation_prompt defaults to true
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"
    reserved = post(base, "/tokenize", {"messages": QUESTION, "chat_template_kwargs": {"tools": 1}})
    assert reserved.json()["error"]["param"] == "chat_template_kwargs"
    untrusted = post(base, "/tokenize", {"messages": QUESTION, "chat_template": "{{ 1 }}"})
    assert untrusted.json()["error"]["code"] == "chat_template_refused"  # no --trust-request-...


def test_the_chat_form_shows_tools_as_the_chat_endpoint_does(base: str) -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, timeout=120, max_retries=0)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,  # type: ignore[arg-type]
        tools=[tool],  # type: ignore[list-item]
        tool_choice="required",
        max_tokens=1,
    )
    assert chat.usage is not None
    with_tools = post(base, "/tokenize", {"messages": QUESTION, "tools": [tool]}).json()
    without = post(base, "/tokenize", {"messages": QUESTION}).json()
    assert with_tools["count"] == chat.usage.prompt_tokens > without["count"]


def test_detokenize_round_trips_and_bounds_its_ids(base: str, tokenizer: Tokenizer) -> None:
    text = "<|im_start|>user\nBonjour, ça va ?"
    ids = tokenizer.encode(text, add_special_tokens=False)
    answer = post(base, "/detokenize", {"model": MODEL, "tokens": ids})
    assert answer.status_code == 200 and answer.json() == {"prompt": text}  # specials kept
    vocab = tokenizer.vocab_size
    for tokens, why in (
        ([vocab], "out of the vocabulary"),
        ([-1], "greater than or equal to 0"),
        ([2**64], ""),
        (["1"], ""),
    ):
        refused = post(base, "/detokenize", {"tokens": tokens})
        assert refused.status_code == 400, tokens
        error = refused.json()["error"]
        assert error["param"] == "tokens" and why in error["message"]
    # More ids than one call may decode, within the body limit: a 400 naming the field.
    many = post(base, "/detokenize", {"tokens": [1] * (MAX_DETOKENIZE_TOKENS + 1)})
    assert many.status_code == 400 and many.json()["error"]["param"] == "tokens"
    # 10^7 ids (20 MB): over the body limit, refused from Content-Length before it is read.
    assert _status_of_declared_body(base, "/detokenize", 20_000_000) == 413
    wrong = post(base, "/detokenize", {"model": "gpt-4o", "tokens": [1]})
    assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "model_not_found"
    assert post(base, "/tokenize", {"prompt": "x", "model": "gpt-4o"}).status_code == 404
    assert post(base, "/tokenize", {"prompt": 3}).json()["error"]["param"] == "prompt"
    assert post(base, "/tokenize", {"messages": []}).json()["error"]["param"] == "messages"


def test_tokenizer_info_version_and_keys(base: str, tokenizer: Tokenizer) -> None:
    info = httpx.get(f"{base}/tokenizer_info", headers=AUTH, timeout=30).json()
    assert info["tokenizer_class"] == "PreTrainedTokenizerFast"  # a GGUF model: no config
    assert info["chat_template"] == tokenizer.chat_template
    assert (info["bos_token"], info["eos_token"]) == (tokenizer.bos_token, tokenizer.eos_token)
    version = httpx.get(f"{base}/version", timeout=30).json()  # open, as /health
    assert version == {"version": metadata.version("corefleet")}
    for path in ("/tokenize", "/detokenize"):
        assert httpx.post(f"{base}{path}", json={"tokens": [1]}, timeout=30).status_code == 401
    assert httpx.get(f"{base}/tokenizer_info", timeout=30).status_code == 401
    assert httpx.get(f"{base}/load", timeout=30).status_code == 200


def test_load_counts_requests_in_flight(base: str) -> None:
    def load() -> int:
        return int(httpx.get(f"{base}/load", timeout=30).json()["server_load"])

    assert load() == 0
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, timeout=120, max_retries=0)
    stream = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=200, stream=True, temperature=0.0
    )
    first = next(iter(stream))  # the request is admitted and streaming
    assert first.choices
    assert load() == 1
    stream.close()  # the client goes away: the request ends
    deadline = time.monotonic() + 60
    while load() != 0:
        assert time.monotonic() < deadline, "the closed stream still counts"
        time.sleep(0.05)


def test_everything_is_served_under_the_root_path(base: str) -> None:
    prefixed = f"{base}{ROOT}"
    client = openai.OpenAI(base_url=f"{prefixed}/v1", api_key=KEY, timeout=120, max_retries=0)
    assert [m.id for m in client.models.list()] == [MODEL]
    done = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)  # native path
    assert done.usage is not None and done.usage.completion_tokens == 2
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2)  # type: ignore[arg-type]
    assert chat.choices[0].message.content
    # The prefix does not get around the key, on the native path or FastAPI's.
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    assert httpx.post(f"{prefixed}/v1/completions", json=body, timeout=60).status_code == 401
    assert httpx.get(f"{prefixed}/v1/models", timeout=60).status_code == 401
    assert httpx.post(f"{prefixed}/tokenize", json={"prompt": "x"}, timeout=60).status_code == 401
    assert httpx.get(f"{prefixed}/version", timeout=60).status_code == 200
    assert httpx.get(f"{prefixed}/ready", timeout=60).status_code == 200
    document = httpx.get(f"{prefixed}/openapi.json", timeout=60).json()
    assert document["servers"] == [{"url": ROOT}]
    assert {"/tokenize", "/detokenize", "/tokenizer_info", "/version", "/load"} <= set(
        document["paths"]
    )
    # A path that only looks like the prefix is not under it.
    assert httpx.get(f"{base}/llmx/v1/models", headers=AUTH, timeout=60).status_code == 404
    assert json.loads(httpx.get(f"{base}/openapi.json", timeout=60).text)["servers"] == [
        {"url": ROOT}
    ]
