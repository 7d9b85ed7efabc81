"""Request and response models of vLLM's tokenizer routes: ``POST /tokenize`` (a prompt, or a
conversation rendered as ``/v1/chat/completions`` renders it), ``POST /detokenize`` and
``GET /tokenizer_info``.

Fields and defaults are vLLM's (``vllm/entrypoints/serve/tokenize/protocol.py``); a ``null``
means the default, as on the generation endpoints. Undeclared fields are ignored.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from corefleet.engine.openai import limits
from corefleet.engine.openai.chat_render import ChatTemplateFields
from corefleet.engine.openai.protocol import ChatMessage, NonNegativeInt64
from corefleet.engine.openai.tool_request import ToolDefinition

_REQUEST_CONFIG = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

# The most token ids one /detokenize may send: the body limit bounds them too, but a server
# with a large --max-request-body-bytes must not decode tens of millions of ids for one call.
MAX_DETOKENIZE_TOKENS = 1 << 20


class TokenizeCompletionRequest(BaseModel):
    """``POST /tokenize`` with a ``prompt``: its tokens as ``/v1/completions`` counts them."""

    model_config = _REQUEST_CONFIG
    model: str | None = None  # None: the served model
    prompt: str
    add_special_tokens: bool | None = True  # BOS/EOS as the model's tokenizer adds them
    return_token_strs: bool | None = False  # also each token as the vocabulary spells it


class TokenizeChatRequest(ChatTemplateFields):
    """``POST /tokenize`` with ``messages``: the conversation through the chat template, the
    prompt ``/v1/chat/completions`` would send the model for the same fields (the chat
    template options of ``ChatTemplateFields``; tools offered as with ``tool_choice`` auto,
    the default)."""

    model_config = _REQUEST_CONFIG
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1, max_length=limits.MAX_MESSAGES)
    return_token_strs: bool | None = False
    tools: list[ToolDefinition] | None = Field(default=None, max_length=limits.MAX_TOOLS)


class TokenizeResponse(BaseModel):
    """The prompt's tokens; ``max_model_len`` is the ranks' context, for the client to compare
    ``count`` with (a prompt is tokenized whatever its length)."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``: ids below the tokenizer's vocabulary size, special ones kept."""

    model_config = _REQUEST_CONFIG
    model: str | None = None
    tokens: list[NonNegativeInt64] = Field(max_length=MAX_DETOKENIZE_TOKENS)


class DetokenizeResponse(BaseModel):
    """The text of the ids."""

    prompt: str


class VersionResponse(BaseModel):
    """``GET /version``."""

    version: str


class LoadResponse(BaseModel):
    """``GET /load``: generation requests in flight (0 without --enable-server-load-tracking)."""

    server_load: int


def tokenizer_info_schema() -> dict[str, Any]:
    """``GET /tokenizer_info``'s answer: the tokenizer's configuration, open-ended as vLLM's
    (``tokenizer_class`` always; the chat template and special tokens when the model has
    them)."""
    text = {"type": "string"}
    return {
        "type": "object",
        "description": "The tokenizer's configuration (tokenizer_config.json's keys)",
        "properties": {"tokenizer_class": text, "chat_template": text},
        "required": ["tokenizer_class"],
        "additionalProperties": True,
    }
