"""OpenAI-compatible response models: what the API answers, whole or streamed.

Responses are dumped with nulls kept (``model_dump_json()``), as OpenAI sends them; stream
chunks without (``errors.sse_event``), which drops ``role`` after the first delta and ``usage``
before the last chunk, as OpenAI streams do. ``protocol`` re-exports every model here, so the
API's models are all ``protocol.X``.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any, Literal

from pydantic import (
    BaseModel,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

# OpenAI's "extremely unlikely": JSON has no -inf (pydantic writes null, the client refuses it).
MIN_LOGPROB = -9999.0


def _finite(value: Any) -> Any:
    return value if value is None or math.isfinite(value) else MIN_LOGPROB


def random_id(prefix: str) -> str:
    """``cmpl-<hex>`` / ``chatcmpl-<hex>``: the id style of OpenAI responses."""
    return f"{prefix}-{uuid.uuid4().hex}"


class PromptTokenUsageInfo(BaseModel):
    """``usage.prompt_tokens_details``: the prompt tokens the prefix cache served."""

    cached_tokens: int = 0


class UsageInfo(BaseModel):
    """Token counts of a request (all ``n`` completions together). ``prompt_tokens_details``
    only with ``--enable-prompt-tokens-details`` (as vLLM), left out otherwise."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None

    # No return annotation on purpose: pydantic would take it for the serialization schema,
    # and /openapi.json would lose the fields of UsageInfo.
    @model_serializer(mode="wrap")
    def _without_null_details(self, handler: SerializerFunctionWrapHandler):  # type: ignore[no-untyped-def]
        # vLLM leaves the key out rather than sending null when the flag is off.
        data: dict[str, Any] = handler(self)
        if data.get("prompt_tokens_details", 0) is None:
            del data["prompt_tokens_details"]
        return data

    @model_validator(mode="after")
    def _total(self) -> UsageInfo:  # derived, so it can never disagree
        self.total_tokens = self.prompt_tokens + self.completion_tokens
        return self


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs: parallel lists, one entry per generated token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)  # from the start of the generated text

    @field_validator("token_logprobs", "top_logprobs")
    @classmethod
    def _clamp(cls, values: list[Any]) -> list[Any]:
        return [
            {k: _finite(x) for k, x in v.items()} if isinstance(v, dict) else _finite(v)
            for v in values
        ]


class Logprob(BaseModel):
    """vLLM's prompt logprob entry: a candidate's logprob, its rank (1 = most likely) and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None

    @field_validator("logprob")
    @classmethod
    def _clamp(cls, value: float) -> float:
        return _finite(value)


# ``prompt_logprobs``: per prompt token (the first null) its id and the top-N ids -> Logprob.
PromptLogprobs = list[dict[int, Logprob] | None]


class CompletionChoice(BaseModel):
    """One completion; ``stop_reason`` (vLLM's extra) is the stop string or token id."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, with prompt_logprobs or echo
    # With return_token_ids (vLLM's): the prompt's ids (a stream's first chunk of the
    # choice) and the generated ids (a stream: each chunk's own).
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    """``text_completion`` object; also the shape of each streamed completions chunk."""

    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class CompletionStreamResponse(CompletionResponse):
    """A streamed completions chunk: every chunk of a stream shares ``id`` and ``created``;
    ``usage`` only on the last one (empty ``choices``) when ``include_usage`` was asked."""


class TopLogprob(BaseModel):
    """A candidate token with its logprob and UTF-8 bytes."""

    token: str
    logprob: float
    bytes: list[int] | None = None

    @field_validator("logprob")
    @classmethod
    def _clamp(cls, value: float) -> float:
        return _finite(value)


class ChatTokenLogprob(TopLogprob):
    """A generated token, with the ``top_logprobs`` alternatives at its position."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    """``choices[i].logprobs`` of a chat completion."""

    content: list[ChatTokenLogprob] | None = None


def tool_call_id() -> str:
    """``call_<hex>``: the id style of OpenAI's tool calls."""
    return f"call_{uuid.uuid4().hex[:24]}"


class FunctionCall(BaseModel):
    """The function a tool call names, with its arguments as JSON text."""

    name: str
    arguments: str


class ChatToolCall(BaseModel):
    """One call of a tool, in a whole answer."""

    id: str = Field(default_factory=tool_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    """The assistant's answer: text, calls of tools, or both (``content`` null without text).
    ``role`` is the last message's when the request set ``add_generation_prompt`` false."""

    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ChatToolCall] | None = None


class ChatChoice(BaseModel):
    """One chat completion."""

    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids: the generated ids


class ChatCompletionResponse(BaseModel):
    """``chat.completion`` object."""

    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids: the rendered prompt's
    prompt_text: str | None = None  # with return_prompt_text: the rendered prompt
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's: one list for every choice


class DeltaFunctionCall(BaseModel):
    """A piece of a streamed call: the name once, then pieces of the arguments' text."""

    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A streamed call's piece; ``index`` tells the calls of one choice apart, ``id`` and
    ``type`` come with its first piece."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(BaseModel):
    """What a chunk adds: ``role`` in the first chunk of a choice, then ``content`` pieces or
    pieces of ``tool_calls``."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    """One choice's increment in a chunk; ``finish_reason`` set on its last one."""

    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids: this chunk's generated ids


class ChatCompletionChunk(BaseModel):
    """``chat.completion.chunk``: chunks of one stream share ``id`` and ``created``; with
    ``include_usage`` the last chunk has empty ``choices`` and ``usage``."""

    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids: in the first chunk
    prompt_text: str | None = None  # with return_prompt_text: in the first chunk


class ModelPermission(BaseModel):
    """vLLM's permission entry of a model card: fixed values, as vLLM sends them."""

    id: str = Field(default_factory=lambda: random_id("modelperm"))
    object: Literal["model_permission"] = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(BaseModel):
    """An entry of ``GET /v1/models`` (and ``GET /v1/models/{model}``), as vLLM's: ``root``
    is the model as ``--model`` named it, ``parent`` None for a base model, ``max_model_len``
    the ranks' context (None while no rank is ready)."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "vllm"  # vLLM's value: clients written for vLLM may compare it
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=lambda: [ModelPermission()])


class ModelList(BaseModel):
    """``GET /v1/models``."""

    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)
