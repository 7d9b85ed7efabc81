"""Request and response models of ``POST /v1/embeddings`` and ``POST /pooling`` (vLLM's
``EmbeddingCompletionRequest`` / ``EmbeddingChatRequest`` and the pooling ones).

One model per endpoint takes both forms: ``input`` (a text, texts, token ids or lists of
token ids) or ``messages`` (a conversation rendered by the chat template, without the
generation prompt unless asked). Known fields are strict, as in ``protocol``; fields they do
not declare are ignored, as vLLM does.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from corefleet.engine.openai import limits
from corefleet.engine.openai.chat_render import (
    MAX_CHAT_TEMPLATE_CHARS,
    MAX_CHAT_TEMPLATE_KWARGS,
    MAX_DOCUMENTS,
    ChatTemplateFields,
)
from corefleet.engine.openai.protocol import ChatMessage
from corefleet.engine.openai.response_models import random_id

_REQUEST_CONFIG = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
_Int64 = Annotated[int, Field(ge=limits.INT64_MIN, le=limits.INT64_MAX)]

# The encodings of a vector in a response: a JSON list of floats, or its bytes in base64.
EncodingFormat = Literal["float", "base64"]
EmbedDtype = Literal["float32", "float16"]
Endianness = Literal["native", "big", "little"]


class PoolingRequest(BaseModel):
    """``POST /v1/embeddings`` and ``POST /pooling`` (whose ``task`` may only be embed)."""

    model_config = _REQUEST_CONFIG
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]] | None = None
    messages: list[ChatMessage] | None = Field(
        default=None, min_length=1, max_length=limits.MAX_MESSAGES
    )
    encoding_format: EncodingFormat = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None
    # Keep only the last N prompt tokens (vLLM's; -1: up to the context length).
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=limits.INT64_MAX)] | None = None
    # Add the tokenizer's BOS/EOS (None: yes for input, no for messages, as vLLM's).
    add_special_tokens: bool | None = None
    use_activation: bool | None = None  # L2-normalise (None: the server's --pooler-config)
    embed_dtype: EmbedDtype = "float32"  # of the base64 bytes
    endianness: Endianness = "native"  # of the base64 bytes
    priority: _Int64 = 0
    # The chat form's (vLLM's defaults: no generation prompt for an embedding).
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    documents: list[dict[str, str]] | None = Field(default=None, max_length=MAX_DOCUMENTS)
    chat_template: str | None = Field(default=None, max_length=MAX_CHAT_TEMPLATE_CHARS)
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, max_length=MAX_CHAT_TEMPLATE_KWARGS
    )
    task: Literal["embed"] | None = None  # /pooling only: the one task this server pools for

    @field_validator("input")
    @classmethod
    def _not_empty(cls, value: Any) -> Any:
        if isinstance(value, list) and (not value or any(v == [] for v in value)):
            raise ValueError("at least one text or token id is required in each input")
        return value

    @model_validator(mode="after")
    def _one_form(self) -> PoolingRequest:
        if (self.input is None) == (self.messages is None):
            raise ValueError("give exactly one of input (texts or token ids) or messages")
        return self

    def prompt_inputs(self) -> list[str | dict[str, list[int]]]:
        """The ``input`` prompts in ``InputProcessor.process_prompt`` form."""
        assert self.input is not None
        items: list[Any] = [self.input] if isinstance(self.input, str) else list(self.input)
        if isinstance(items[0], int):  # one prompt given as token ids
            return [{"prompt_token_ids": items}]
        return [x if isinstance(x, str) else {"prompt_token_ids": list(x)} for x in items]

    def chat_fields(self) -> ChatTemplateFields:
        """The chat form's template options, for ``chat_render`` (the one renderer)."""
        return ChatTemplateFields(
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
            add_special_tokens=bool(self.add_special_tokens),
            documents=self.documents,
            chat_template=self.chat_template,
            chat_template_kwargs=self.chat_template_kwargs,
        )

    def template_messages(self) -> list[dict[str, Any]]:
        """``messages`` for ``Tokenizer.apply_chat_template`` (developer is system there)."""
        assert self.messages is not None
        return [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in self.messages
        ]


class EmbeddingData(BaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # floats, or base64 of the vector's bytes


class PoolingData(BaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | str


class PoolingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class EmbeddingResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("embd"))
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage


class PoolingResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("pool"))
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[PoolingData]
    usage: PoolingUsage
