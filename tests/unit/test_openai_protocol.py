"""OpenAI protocol models: request validation and conversion, error bodies, and responses that
the official ``openai`` client parses (with its own types and through a real client)."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from corefleet.engine.messages import FinishReason
from corefleet.engine.openai.errors import (
    SSE_DONE,
    ErrorResponse,
    RequestError,
    error_from_json,
    parse_request,
    sse_error,
    sse_event,
)
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
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    TopLogprob,
    UsageInfo,
    openai_finish_reason,
    to_sampling_params,
)
from corefleet.engine.openai.protocol import ChatCompletionChunk as ChatCompletionChunkModel

try:  # the openai client moved from httpx to httpx2; mock the transport of whichever it uses
    import httpx2 as httpx
except ImportError:  # pragma: no cover - older openai clients
    import httpx  # type: ignore[no-redef]

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}


def chat(**fields: Any) -> Any:
    return to_sampling_params(parse_request(ChatCompletionRequest, {**CHAT, **fields}))


def completion(**fields: Any) -> Any:
    return to_sampling_params(parse_request(CompletionRequest, {**COMPLETION, **fields}))


def refused(kind: type, body: dict[str, Any] | str | bytes) -> RequestError:
    with pytest.raises(RequestError) as info:
        to_sampling_params(parse_request(kind, body))
    assert info.value.status == 400
    assert info.value.type == "invalid_request_error"
    return info.value


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


def test_unknown_fields_are_ignored_but_known_fields_are_strict() -> None:
    request = parse_request(ChatCompletionRequest, {**CHAT, "metadata": {"x": 1}, "foo": 2})
    assert not hasattr(request, "foo")
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
            {**CHAT, "response_format": {"type": "json_object"}},
            "response_format",
        ),
        (ChatCompletionRequest, {**CHAT, "logit_bias": {"1": 5.0}}, "logit_bias"),
        (ChatCompletionRequest, {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        (ChatCompletionRequest, {"messages": [{"role": "user"}]}, "messages"),
        (CompletionRequest, {**COMPLETION, "max_tokens": 0}, "max_tokens"),
        (CompletionRequest, {**COMPLETION, "logprobs": 6}, "logprobs"),
        (CompletionRequest, {**COMPLETION, "logprobs": -1}, "logprobs"),
        (CompletionRequest, {**COMPLETION, "echo": True}, "echo"),
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
    assert "echo" in refused(CompletionRequest, {**COMPLETION, "echo": True}).message


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
    models = ModelList(data=[ModelCard(id="qwen", max_model_len=4096)])
    body = json.loads(models.model_dump_json())
    assert body["object"] == "list"
    theirs = Model.model_validate(body["data"][0])
    assert (theirs.id, theirs.object, theirs.owned_by) == ("qwen", "model", "corefleet")
    assert isinstance(theirs.created, int)
    assert theirs.model_extra == {"max_model_len": 4096}


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
    assert (model.id, model.owned_by) == ("qwen", "corefleet")


def test_error_response_model_parses_its_own_body() -> None:
    body = RequestError("x", param="stop").to_response().model_dump_json()
    assert ErrorResponse.model_validate_json(body).error.param == "stop"
