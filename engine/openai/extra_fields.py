"""Request fields beyond the ones the request models declare: refused when they would change
the answer, otherwise ignored with a warning in the log.

Clients send more than OpenAI's core parameters: vLLM's extras (``logits_processors``,
``vllm_xargs``...), newer OpenAI ones (``tool_choice``,
``modalities``...), and whatever an SDK or a proxy adds. Ignoring a field that constrains or
reshapes the output would answer a different question with a 200, so each field in
:data:`REFUSED` gets a 400 naming it, unless its value is one that changes nothing (null, or
the behaviour this server has anyway). Any other field is ignored, as vLLM does, and named in a
warning, except the known ones that change nothing (:data:`IGNORED_QUIETLY`).
``docs/coordinator.md`` lists all three kinds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from corefleet.engine.openai.errors import RequestError

logger = logging.getLogger(__name__)

# At most this many unknown names, each cut to this many characters, go into one warning.
_MAX_NAMES_LOGGED = 16
_MAX_NAME_CHARS = 64


@dataclass(frozen=True)
class Refused:
    """A field this server does not implement: ``what`` it asks for, and which values of it
    change nothing (``None`` always does)."""

    what: str
    harmless: Callable[[Any], bool] = lambda value: False


def _one_of(*values: Any) -> Callable[[Any], bool]:
    return lambda value: any(value == v and type(value) is type(v) for v in values)


def _empty(value: Any) -> bool:
    return isinstance(value, (list, dict, str)) and not value


# Both endpoints. vLLM's names first, then OpenAI's.
_COMMON: dict[str, Refused] = {
    "logits_processors": Refused("logits processors", _empty),
    "vllm_xargs": Refused("vllm_xargs (custom sampling extensions)", _empty),
    "watermarking": Refused("watermarking", _one_of(False)),
    "thinking_token_budget": Refused("a thinking token budget", _one_of(-1)),
    "repetition_detection": Refused("repetition detection"),
    "kv_transfer_params": Refused("KV transfer (disaggregated prefill)", _empty),
    "ec_transfer_params": Refused("encoder-cache transfer", _empty),
    "functions": Refused("function calling", _empty),
    "function_call": Refused("function calling", _one_of("none", "auto")),
    "modalities": Refused("output modalities other than text", _one_of(["text"])),
    "audio": Refused("audio output"),
    "web_search_options": Refused("web search"),
}

REFUSED: Mapping[str, Mapping[str, Refused]] = {
    "completions": _COMMON
    | {
        # Embeddings instead of (or beside) the prompt: never the prompt alone in their place.
        "prompt_embeds": Refused("prompt embeddings (prompt_embeds)", _empty),
        "add_special_tokens": Refused("add_special_tokens=false", _one_of(True)),
        "tool_choice": Refused("tool calling (chat only)", _one_of("none", "auto")),
        "reasoning_effort": Refused("reasoning_effort (chat only: a chat template reads it)"),
    },
    "chat": _COMMON,  # vLLM's chat-template fields are declared (chat_render.py)
    # POST /v1/responses (responses_models.py): OpenAI's fields it does not serve.
    "responses": {
        "reasoning": Refused("reasoning options", _empty),
        "background": Refused("background responses", _one_of(False)),
        "include": Refused("extra output (include)", _empty),
        "top_logprobs": Refused("logprobs in responses", _one_of(0)),
        "conversation": Refused("stored conversations (use previous_response_id)"),
        "prompt": Refused("stored prompt templates"),
        "max_tool_calls": Refused("max_tool_calls"),
    },
}


# Known fields that change nothing in the answer: ignored without a word. OpenAI's bookkeeping
# and hints, and vLLM's fields that only matter next to a refused one.
IGNORED_QUIETLY = frozenset(
    {
        "metadata",
        "store",
        "service_tier",
        "parallel_tool_calls",  # completions: only with tools, which chat alone takes
        "prediction",  # predicted outputs: a speed hint
        "request_id",
        "guided_decoding_backend",  # the server's backend (llguidance) is not per request
        "guided_whitespace_pattern",  # whitespace between JSON tokens is already flexible
        "safety_identifier",  # Responses: the end user's id, for OpenAI's abuse checks
        "prompt_cache_key",  # a cache hint; the prefix cache needs none
        # vLLM's that change nothing here: a routing hint, a chunking hint (each token is sent
        # as it comes), data only its render endpoints or its routed-experts flag return,
        # reasoning-parser and multimodal options (no reasoning parser, text content only),
        # and spacing that only vLLM's slow tokenizers apply (every tokenizer here is fast).
        "session_id",
        "stream_interval",
        "routed_experts_prompt_start",
        "return_token_offsets",
        "return_mm_kwargs",
        "include_reasoning",
        "media_io_kwargs",
        "mm_processor_kwargs",
        "spaces_between_special_tokens",
        "stream_options",  # Responses: obfuscation padding of stream events
    }
)


def check_extra_fields(extra: Mapping[str, Any] | None, endpoint: str) -> None:
    """Refuse the first field of ``extra`` (the request's undeclared fields) that
    :data:`REFUSED` lists for ``endpoint`` with a value that would change the answer; log the
    names of the others, which are ignored (those in :data:`IGNORED_QUIETLY` without a word).

    Raises:
        RequestError: 400 naming the field.
    """
    if not extra:
        return
    refused = REFUSED[endpoint]
    unknown = []
    for name, value in extra.items():
        rule = refused.get(name)
        if rule is None:
            if name not in IGNORED_QUIETLY:
                unknown.append(name)
        elif value is not None and not rule.harmless(value):
            raise RequestError(f"{name}: {rule.what} is not supported by this server", param=name)
    if unknown:
        shown = ", ".join(repr(n[:_MAX_NAME_CHARS]) for n in unknown[:_MAX_NAMES_LOGGED])
        more = len(unknown) - _MAX_NAMES_LOGGED
        logger.warning(
            "ignored unknown request field(s): %s%s", shown, f" and {more} more" if more > 0 else ""
        )
