"""OpenAI responses and SSE framing, parsed by the official client's types and a real client."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from corefleet.engine.messages import FinishReason
from corefleet.engine.openai.errors import SSE_DONE, RequestError, sse_error, sse_event
from corefleet.engine.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    TopLogprob,
    UsageInfo,
    openai_finish_reason,
)
from corefleet.engine.openai.protocol import ChatCompletionChunk as ChatCompletionChunkModel
from corefleet.engine.openai.responses import _ChunkEvents
from tests.unit.openai_helpers import CHAT, refused

try:  # the openai client moved from httpx to httpx2; mock the transport of whichever it uses
    import httpx2 as httpx
except ImportError:  # pragma: no cover - older openai clients
    import httpx  # type: ignore[no-redef]


# -- responses, parsed by the official client's types ---------------------------------------

USAGE = UsageInfo(prompt_tokens=3, completion_tokens=2)


def test_usage_total_is_derived() -> None:
    assert USAGE.total_tokens == 5


def test_completion_round_trip() -> None:
    logprobs = CompletionLogprobs(
        tokens=["Hel", "lo"],
        token_logprobs=[-0.5, float("-inf")],  # -inf is not JSON: clamped to OpenAI's -9999
        top_logprobs=[{"Hel": -0.5, "Hi": -1.0}, {"lo": -9999.0}],
        text_offset=[0, 3],
    )
    ours = CompletionResponse(
        model="m",
        choices=[
            CompletionChoice(index=0, text="Hello", logprobs=logprobs, finish_reason="length")
        ],
        usage=USAGE,
    )
    theirs = Completion.model_validate_json(ours.model_dump_json())
    assert theirs.id.startswith("cmpl-") and theirs.object == "text_completion"
    choice = theirs.choices[0]
    assert (choice.text, choice.finish_reason, choice.index) == ("Hello", "length", 0)
    assert choice.logprobs is not None
    assert choice.logprobs.tokens == ["Hel", "lo"]
    assert choice.logprobs.token_logprobs == [-0.5, -9999.0]
    assert choice.logprobs.top_logprobs == [{"Hel": -0.5, "Hi": -1.0}, {"lo": -9999.0}]
    assert choice.logprobs.text_offset == [0, 3]
    assert theirs.usage is not None
    assert (theirs.usage.prompt_tokens, theirs.usage.completion_tokens) == (3, 2)
    assert theirs.usage.total_tokens == 5


def chat_logprobs() -> ChatLogprobs:
    top = [
        TopLogprob(token="Hi", logprob=-0.1, bytes=[72, 105]),
        TopLogprob(token="Yo", logprob=-2.5),
    ]
    return ChatLogprobs(
        content=[ChatTokenLogprob(token="Hi", logprob=-0.1, bytes=[72, 105], top_logprobs=top)]
    )


def test_chat_completion_round_trip() -> None:
    ours = ChatCompletionResponse(
        model="m",
        choices=[
            ChatChoice(
                index=0,
                message=ChatResponseMessage(content="Hi"),
                logprobs=chat_logprobs(),
                finish_reason="stop",
                stop_reason="\n",
            )
        ],
        usage=USAGE,
    )
    theirs = ChatCompletion.model_validate_json(ours.model_dump_json())
    assert theirs.id.startswith("chatcmpl-") and theirs.object == "chat.completion"
    choice = theirs.choices[0]
    assert (choice.message.role, choice.message.content) == ("assistant", "Hi")
    assert choice.finish_reason == "stop"
    assert choice.logprobs is not None and choice.logprobs.content is not None
    token = choice.logprobs.content[0]
    assert (token.token, token.logprob, token.bytes) == ("Hi", -0.1, [72, 105])
    assert [(t.token, t.logprob, t.bytes) for t in token.top_logprobs] == [
        ("Hi", -0.1, [72, 105]),
        ("Yo", -2.5, None),
    ]
    assert theirs.usage is not None and theirs.usage.total_tokens == 5
    assert json.loads(ours.model_dump_json())["choices"][0]["stop_reason"] == "\n"  # vLLM extra


def chat_chunks() -> list[ChatCompletionChunkModel]:
    common: dict[str, Any] = {"id": "chatcmpl-1", "created": 1, "model": "m"}
    return [
        ChatCompletionChunkModel(
            **common,
            choices=[ChatChunkChoice(index=0, delta=DeltaMessage(role="assistant", content=""))],
        ),
        ChatCompletionChunkModel(
            **common,
            choices=[
                ChatChunkChoice(index=0, delta=DeltaMessage(content="Hi"), logprobs=chat_logprobs())
            ],
        ),
        ChatCompletionChunkModel(
            **common, choices=[ChatChunkChoice(index=0, delta=DeltaMessage(), finish_reason="stop")]
        ),
        ChatCompletionChunkModel(**common, choices=[], usage=USAGE),
    ]


def test_chat_chunks_round_trip_through_sse_json() -> None:
    parsed = []
    for event in map(sse_event, chat_chunks()):
        assert event.startswith("data: ") and event.endswith("\n\n")
        parsed.append(ChatCompletionChunk.model_validate_json(event.removeprefix("data: ")))
    first, middle, last, usage = parsed
    assert first.object == "chat.completion.chunk" and first.id == "chatcmpl-1"
    assert (first.choices[0].delta.role, first.choices[0].delta.content) == ("assistant", "")
    assert middle.choices[0].delta.role is None and middle.choices[0].delta.content == "Hi"
    assert middle.choices[0].logprobs is not None
    assert middle.choices[0].logprobs.content is not None
    assert middle.choices[0].logprobs.content[0].top_logprobs[1].token == "Yo"
    assert middle.choices[0].finish_reason is None and middle.usage is None
    assert last.choices[0].finish_reason == "stop"
    assert usage.choices == [] and usage.usage is not None and usage.usage.total_tokens == 5
    # Left out, not null: role after the first delta, usage before the last chunk.
    assert '"role"' not in sse_event(chat_chunks()[1]) and '"usage"' not in sse_event(
        chat_chunks()[1]
    )


def test_models_round_trip() -> None:
    models = ModelList(data=[ModelCard(id="qwen", root="/models/qwen", max_model_len=4096)])
    body = json.loads(models.model_dump_json())
    assert body["object"] == "list"
    theirs = Model.model_validate(body["data"][0])
    assert (theirs.id, theirs.object, theirs.owned_by) == ("qwen", "model", "vllm")
    assert isinstance(theirs.created, int)
    extra = theirs.model_extra or {}
    assert (extra["root"], extra["parent"], extra["max_model_len"]) == ("/models/qwen", None, 4096)
    # vLLM's permission entry, field for field.
    (permission,) = extra["permission"]
    assert permission.pop("id").startswith("modelperm-")
    assert isinstance(permission.pop("created"), int)
    assert permission == {
        "object": "model_permission",
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }


def test_sse_framing() -> None:
    assert SSE_DONE == "data: [DONE]\n\n"
    event = sse_event(UsageInfo(prompt_tokens=1))
    assert event == 'data: {"prompt_tokens":1,"completion_tokens":0,"total_tokens":1}\n\n'
    error = sse_error(RequestError("bad", param="n"))
    assert json.loads(error.removeprefix("data: ")) == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "n", "code": None}
    }


def test_finish_reasons() -> None:
    assert openai_finish_reason(FinishReason.STOP) == "stop"
    assert openai_finish_reason(FinishReason.LENGTH) == "length"
    assert openai_finish_reason(FinishReason.ABORT) == "abort"
    assert openai_finish_reason(FinishReason.ERROR) == "error"
    assert openai_finish_reason("stop") == "stop" and openai_finish_reason(None) is None
    with pytest.raises(ValueError, match="rejected"):
        openai_finish_reason(FinishReason.REJECTED)


# -- through a real openai client (offline: an httpx mock transport) ------------------------


def client_answering(
    status: int, body: str, content_type: str = "application/json"
) -> openai.OpenAI:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, content=body.encode(), headers={"content-type": content_type})

    transport = httpx.MockTransport(handler)
    return openai.OpenAI(
        api_key="x",
        base_url="http://test/v1",
        http_client=httpx.Client(transport=transport),
        max_retries=0,
    )


def test_real_client_streams_chat_chunks() -> None:
    body = "".join(map(sse_event, chat_chunks())) + SSE_DONE
    client = client_answering(200, body, "text/event-stream")
    stream = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "x"}], stream=True
    )
    chunks = list(stream)
    assert len(chunks) == 4
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hi"
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 5


def test_real_client_streams_completions() -> None:
    chunk = CompletionStreamResponse(
        id="cmpl-1", created=1, model="m", choices=[CompletionChoice(index=0, text="He")]
    )
    done = CompletionStreamResponse(
        id="cmpl-1",
        created=1,
        model="m",
        choices=[CompletionChoice(index=0, text="y", finish_reason="stop")],
    )
    client = client_answering(
        200, sse_event(chunk) + sse_event(done) + SSE_DONE, "text/event-stream"
    )
    chunks = list(client.completions.create(model="m", prompt="x", stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "Hey"
    assert [c.choices[0].finish_reason for c in chunks] == [None, "stop"]


def test_real_client_raises_our_errors() -> None:
    error = refused(ChatCompletionRequest, {**CHAT, "n": 0})
    client = client_answering(error.status, error.to_response().model_dump_json())
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], n=0)
    assert info.value.param == "n" and info.value.type == "invalid_request_error"
    assert "n: " in info.value.message and "greater than or equal to 1" in info.value.message
    # Inside a stream (status already 200), an error event makes the client raise too.
    client = client_answering(
        200, sse_error(RequestError("engine died", status=500)), "text/event-stream"
    )
    with pytest.raises(openai.APIError, match="engine died"):
        list(client.completions.create(model="m", prompt="x", stream=True))


def test_real_client_accepts_abort_and_lists_models() -> None:
    aborted = CompletionResponse(
        model="m",
        choices=[CompletionChoice(index=0, text="Hel", finish_reason="abort")],
        usage=USAGE,
    )
    client = client_answering(200, aborted.model_dump_json())
    assert client.completions.create(model="m", prompt="x").choices[0].finish_reason == "abort"
    # The client's declared types do not list "abort": strict validation refuses it.
    with pytest.raises(ValueError):
        Completion.model_validate_json(aborted.model_dump_json())
    client = client_answering(
        200, ModelList(data=[ModelCard(id="qwen", max_model_len=8)]).model_dump_json()
    )
    (model,) = client.models.list()
    assert (model.id, model.owned_by) == ("qwen", "vllm")


TRICKY_TEXTS = [
    "",
    "plain",
    'quote " and \\ backslash',
    "line\nbreak\ttab",
    "é ü 你好 🙂",
    "\x00\x1f",
]


@pytest.mark.parametrize("text", TRICKY_TEXTS)
@pytest.mark.parametrize("finish", [None, FinishReason.LENGTH])
def test_a_streamed_chunk_is_the_json_of_its_model(text: str, finish: FinishReason | None) -> None:
    """Stream chunks are encoded once per stream for their shared fields and once per choice;
    the bytes must be exactly what dumping the chunk's model (nulls left out) gives."""
    reason = openai_finish_reason(finish)
    completion = CompletionStreamResponse(model="m\u00e9", choices=[])
    events = _ChunkEvents(completion)
    choice = CompletionChoice(index=3, text=text, finish_reason=reason)
    expected = sse_event(completion.model_copy(update={"choices": [choice]}))
    assert events.choice({"index": 3, "text": text, "finish_reason": reason}) == expected

    chat = ChatCompletionChunkModel(model="m", choices=[])
    events = _ChunkEvents(chat)
    delta = {"role": "assistant", "content": text}
    model_choice = ChatChunkChoice(index=0, delta=DeltaMessage(**delta), finish_reason=reason)
    expected = sse_event(chat.model_copy(update={"choices": [model_choice]}))
    assert events.choice({"index": 0, "delta": delta, "finish_reason": reason}) == expected
    parsed = ChatCompletionChunk.model_validate_json(expected.removeprefix("data: "))
    assert parsed.choices[0].delta.content == text
