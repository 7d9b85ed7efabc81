"""The token-level controls of a request (vLLM's extras on both endpoints), as the engine's
:class:`SamplingParams` fields: ``logit_bias``, ``allowed_token_ids``, ``bad_words`` and
``logprob_token_ids``. Their bounds and vocabulary checks live in ``token_controls.py``;
``SamplingParams.validate`` applies them, so a bad id gets a 400 naming its field.
"""

from __future__ import annotations

from typing import Annotated, Any, Protocol

from pydantic import BeforeValidator, Field

from corefleet.engine.openai.errors import RequestError
from corefleet.engine.token_controls import (
    MAX_ABS_LOGIT_BIAS,
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORD_CHARS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_LOGPROB_TOKEN_IDS,
)

# A response's top_k that keeps every logprob the engine reported (logprob_token_ids).
ALL_REPORTED = 2**63 - 1


# Declared field types of the request models (protocol.py), bounded before anything is built.
def _whole(value: Any) -> Any:
    """``5.0`` as ``5``: JSON does not tell an integral number's spellings apart."""
    return int(value) if type(value) is float and value.is_integer() else value


TokenId = Annotated[int, Field(ge=0, le=2**63 - 1), BeforeValidator(_whole)]
LogitBias = Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS_TOKENS)]
AllowedTokenIds = Annotated[list[TokenId], Field(max_length=MAX_ALLOWED_TOKEN_IDS)]
BadWords = Annotated[
    list[Annotated[str, Field(min_length=1, max_length=MAX_BAD_WORD_CHARS)]],
    Field(max_length=MAX_BAD_WORDS),
]
LogprobTokenIds = Annotated[list[TokenId], Field(max_length=MAX_LOGPROB_TOKEN_IDS)]


class _TokenFields(Protocol):
    logit_bias: dict[str, float] | None
    allowed_token_ids: list[int] | None
    bad_words: list[str] | None
    logprob_token_ids: list[int] | None


def token_controls(
    request: _TokenFields, logprobs: int | None
) -> tuple[int | None, dict[str, Any]]:
    """The engine's ``logprobs`` and the token-control fields of ``request``, whose
    ``logprobs`` (chat: ``top_logprobs`` with ``logprobs: true``) the caller resolved.

    As vLLM: ``logit_bias`` keys are token ids as strings and its values are clamped to
    [-100, 100]; with ``logprob_token_ids`` the engine reports those tokens' logprobs instead of
    a top-N (the request's count is not used), so the request must ask for logprobs.

    Raises:
        RequestError: a ``logit_bias`` key that is not an integer, or ``logprob_token_ids``
            without logprobs.
    """
    fields: dict[str, Any] = {}
    if request.logit_bias:
        fields["logit_bias"] = _logit_bias(request.logit_bias)
    if request.allowed_token_ids is not None:
        fields["allowed_token_ids"] = list(request.allowed_token_ids)
    if request.bad_words:
        fields["bad_words"] = list(request.bad_words)
    if request.logprob_token_ids:
        if logprobs is None:
            raise RequestError(
                "logprob_token_ids requires logprobs (chat: logprobs=true)",
                param="logprob_token_ids",
            )
        fields["logprob_token_ids"] = list(request.logprob_token_ids)
        logprobs = None
    return logprobs, fields


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise RequestError(
                f"logit_bias: key {key[:50]!r} is not a token id (an integer)", param="logit_bias"
            ) from None
        out[token] = max(-MAX_ABS_LOGIT_BIAS, min(MAX_ABS_LOGIT_BIAS, value))
    return out


def below_pattern(n: int) -> str:
    """A regex of the decimal integers in ``[0, n)`` (no leading zeros; ``n >= 1``): the token
    ids a ``logit_bias`` key may name, for ``/openapi.json``."""
    top = str(n - 1)
    width = len(top)
    shorter = ["0"] if width == 1 else ["0", f"[1-9][0-9]{{0,{width - 2}}}"]
    same: list[str] = []  # numbers of top's width that are at most top
    for i, digit in enumerate(top):
        low = 1 if i == 0 else 0
        if int(digit) > low:
            same.append(f"{top[:i]}[{low}-{int(digit) - 1}][0-9]{{{width - i - 1}}}")
    same.append(top)
    return "^(" + "|".join(dict.fromkeys(shorter + same)) + ")$"


def token_control_schemas(props: dict[str, Any], vocab: int | None, chat: bool) -> list[Any]:
    """Patch the token controls' bounds that depend on the vocabulary into a generation
    request's ``props`` (``/openapi.json``); returns the cross-field rules to add to its
    ``allOf`` (``logprob_token_ids`` needs logprobs)."""
    token: dict[str, Any] = {"type": "integer", "minimum": 0}
    if vocab is not None:
        token["maximum"] = vocab - 1
    most_allowed = MAX_ALLOWED_TOKEN_IDS if vocab is None else min(MAX_ALLOWED_TOKEN_IDS, vocab)
    most_named = MAX_LOGPROB_TOKEN_IDS if vocab is None else min(MAX_LOGPROB_TOKEN_IDS, vocab)
    key = "^(0|[1-9][0-9]*)$" if vocab is None else below_pattern(vocab)
    null = {"type": "null"}
    props["logit_bias"] = {
        "anyOf": [
            {
                "type": "object",
                "maxProperties": MAX_LOGIT_BIAS_TOKENS,
                "propertyNames": {"pattern": key},
                "additionalProperties": {"type": "number"},
            },
            null,
        ],
        "default": None,
        "description": "token id (a string) -> bias added to its logit, clamped to [-100, 100]",
    }
    props["allowed_token_ids"] = {
        "anyOf": [{"type": "array", "items": token, "minItems": 1, "maxItems": most_allowed}, null],
        "default": None,
        "description": "only these tokens may be sampled",
    }
    props["logprob_token_ids"] = {
        "anyOf": [{"type": "array", "items": token, "maxItems": most_named}, null],
        "default": None,
        "description": "report these tokens' logprobs instead of the top ones; needs logprobs",
    }
    props["bad_words"]["description"] = "words (tokenized with and without a leading space) "
    props["bad_words"]["description"] += "that may not be generated"
    none_named = {"properties": {"logprob_token_ids": {"anyOf": [null, {"maxItems": 0}]}}}
    asked = (
        {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}
        if chat
        else {"required": ["logprobs"], "properties": {"logprobs": {"type": "integer"}}}
    )
    return [{"anyOf": [none_named, asked]}]
