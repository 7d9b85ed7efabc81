"""Wire-level helpers of the OpenAI API: errors, request-body parsing, SSE framing.

Every client mistake becomes ``{"error": {"message", "type", "param", "code"}}`` with an HTTP
status, the shape the official ``openai`` client turns into ``BadRequestError`` and friends
(it reads ``message``, ``type``, ``param`` and ``code`` from the ``error`` object).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

__all__ = [
    "BEAM_SEARCH_CONFLICT",
    "CHAT_TEMPLATE_REFUSED",
    "CONSTRAINT_CONFLICT",
    "CONTEXT_LENGTH_EXCEEDED",
    "DUPLICATE_TOOL_NAMES",
    "EMPTY_PROMPT",
    "INVALID_GRAMMAR",
    "INVALID_TOOL_CHOICE",
    "MIN_TOKENS_ABOVE_MAX_TOKENS",
    "PROMPT_LOGPROBS_WITH_STREAM",
    "SCHEMA_VALID_REFUSALS",
    "SSE_DONE",
    "TOKEN_OUT_OF_VOCABULARY",
    "ZERO_MAX_TOKENS_WITHOUT_ECHO",
    "ErrorInfo",
    "ErrorResponse",
    "RequestError",
    "error_from_json",
    "error_from_sampling",
    "error_from_validation",
    "parse_request",
    "sse_error",
    "sse_event",
    "unsupported",
]

ModelT = TypeVar("ModelT", bound=BaseModel)

# The ``code`` of a 400 for a request that no JSON Schema can tell from an acceptable one: the
# rule counts tokens (only the tokenizer knows them) or compares two fields. Everything else is
# in the OpenAPI document (``openapi.py``), which lists these codes.
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's code for the same refusal
MIN_TOKENS_ABOVE_MAX_TOKENS = "min_tokens_above_max_tokens"
EMPTY_PROMPT = "empty_prompt"
CHAT_TEMPLATE_REFUSED = "chat_template_refused"
INVALID_GRAMMAR = "invalid_grammar"
CONSTRAINT_CONFLICT = "constraint_conflict"
INVALID_TOOL_CHOICE = "invalid_tool_choice"
DUPLICATE_TOOL_NAMES = "duplicate_tool_names"
BEAM_SEARCH_CONFLICT = "beam_search_conflict"
TOKEN_OUT_OF_VOCABULARY = "token_out_of_vocabulary"
# Two fields compared, which the schema could say, but each such rule multiplies the branches
# schemathesis must combine, and it gives up past a few: documented as codes instead.
ZERO_MAX_TOKENS_WITHOUT_ECHO = "zero_max_tokens_without_echo"
PROMPT_LOGPROBS_WITH_STREAM = "prompt_logprobs_with_stream"
SCHEMA_VALID_REFUSALS: dict[str, str] = {
    TOKEN_OUT_OF_VOCABULARY: "a /detokenize id below the model's vocabulary size but not below "
    "its tokenizer's (a model whose embedding table is padded past the vocabulary)",
    CONTEXT_LENGTH_EXCEEDED: "the prompt, counted in tokens, does not leave room in the "
    "model's context (max_model_len) for max_tokens (or min_tokens) more tokens",
    MIN_TOKENS_ABOVE_MAX_TOKENS: "min_tokens is larger than max_tokens",
    ZERO_MAX_TOKENS_WITHOUT_ECHO: "max_tokens is 0 on /v1/completions without echo: true",
    PROMPT_LOGPROBS_WITH_STREAM: "prompt_logprobs above 0 with stream: true (as vLLM: a stream "
    "has no place for them)",
    EMPTY_PROMPT: "the prompt's text has no token (only characters the tokenizer drops)",
    CHAT_TEMPLATE_REFUSED: "the chat template refused the conversation (for example a role or "
    "an order of roles it does not support, or chat_template_kwargs it cannot render), or the "
    "request's own chat_template was refused (it does not parse, or the server runs without "
    "--trust-request-chat-template)",
    INVALID_GRAMMAR: "the JSON schema, regex or grammar that constrains the output is not one "
    "the grammar backend can compile, or is longer than 65,536 characters",
    CONSTRAINT_CONFLICT: "more than one field constrains the output (response_format, "
    "structured_outputs, guided_*, tool_choice required or named), or one does next to "
    "ignore_eos or min_tokens",
    DUPLICATE_TOOL_NAMES: "two tools name the same function",
    BEAM_SEARCH_CONFLICT: "use_beam_search with what a beam search cannot honour: logprobs, "
    "echo, structured outputs or tool calling, or n above 10",
    INVALID_TOOL_CHOICE: "tool_choice names a function that is not in tools, is set without "
    "tools, or is auto (the default with tools) on a server started without "
    "--enable-auto-tool-choice",
}


class ErrorInfo(BaseModel):
    """The ``error`` object of an OpenAI error body."""

    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """An OpenAI error body. Dump it with nulls kept: ``param`` and ``code`` are always present."""

    error: ErrorInfo


class RequestError(Exception):
    """A request the API refuses, carrying its HTTP status and the OpenAI error fields.

    ``type`` defaults to ``invalid_request_error`` for 4xx and ``server_error`` for 5xx, the
    values OpenAI uses; ``param`` names the offending top-level request field, if any.
    """

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        status: int = 400,
        type: str | None = None,
        code: str | int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.code = code

    def to_response(self) -> ErrorResponse:
        """The body to send with :attr:`status`."""
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        )

    def __repr__(self) -> str:
        return f"RequestError(status={self.status}, param={self.param!r}, {self.message!r})"


def _path(loc: tuple[int | str, ...]) -> str:
    """``("messages", 0, "role")`` -> ``messages[0].role``: readable in an error message."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def error_from_json(detail: str | Exception) -> RequestError:
    """A 400 for a body that is not valid JSON (no field to blame, so ``param`` is None)."""
    return RequestError(f"the request body is not valid JSON: {detail}")


def error_from_validation(exc: ValidationError) -> RequestError:
    """A 400 naming the first offending field of a pydantic ``ValidationError``.

    ``param`` is the top-level field (``messages`` for ``messages[0].role``) so that callers can
    rely on it whatever nesting pydantic reports; the full path is in the message.
    """
    errors = exc.errors(include_url=False)
    if not errors:  # pragma: no cover - pydantic never raises an empty ValidationError
        return RequestError(str(exc))
    first = errors[0]
    if first["type"] == "json_invalid":
        return error_from_json(first.get("ctx", {}).get("error", first["msg"]))
    loc = tuple(first["loc"])
    if not loc:  # the body itself: not an object, or a model-level check failed
        if first["type"] in ("model_type", "model_attributes_type", "dict_type"):
            return RequestError("the request body must be a JSON object")
        return RequestError(first["msg"].removeprefix("Value error, "))
    message = first["msg"].removeprefix("Value error, ")
    param = loc[0] if isinstance(loc[0], str) else None
    return RequestError(f"{_path(loc)}: {message}", param=param)


def unsupported(param: str, what: str) -> RequestError:
    """A 400 for a known OpenAI parameter whose meaning this server does not implement."""
    return RequestError(f"{param}: {what} is not supported by this server", param=param)


_SAMPLING_FIELD = re.compile(r"invalid sampling parameter (\w+)=")


def error_from_sampling(exc: ValueError, renamed: Mapping[str, str]) -> RequestError:
    """A 400 from ``SamplingParams.validate``'s ``ValueError``, naming the request field.

    ``renamed`` maps engine names to the request's where they differ (chat ``top_logprobs``
    is the engine's ``logprobs``), so the user is told about the field they sent.
    """
    message = str(exc)
    match = _SAMPLING_FIELD.match(message)
    if match is None:
        return RequestError(message)
    name = match.group(1)
    param = renamed.get(name, name)
    above_max = name == "min_tokens" and "must not exceed max_tokens" in message
    return RequestError(
        message.replace(f"parameter {name}=", f"parameter {param}=", 1),
        param=param,
        code=MIN_TOKENS_ABOVE_MAX_TOKENS if above_max else None,
    )


def parse_request(model: type[ModelT], body: bytes | str | Mapping[str, Any]) -> ModelT:
    """Validate a raw body (JSON text) or an already decoded mapping as ``model``.

    Raises:
        RequestError: malformed JSON, not an object, or a field that fails validation.
    """
    try:
        if isinstance(body, bytes | str):
            return model.model_validate_json(body)
        return model.model_validate(body)
    except ValidationError as exc:
        raise error_from_validation(exc) from None


# -- server-sent events ---------------------------------------------------------------------

SSE_DONE = "data: [DONE]\n\n"


def sse_event(model: BaseModel, *, exclude_none: bool = True) -> str:
    """One SSE event: ``data: <json>`` and a blank line.

    None fields are left out by default: that drops ``role`` from all but the first delta and
    ``usage`` from all but the last chunk, as OpenAI's streams do; the official client reads a
    missing field as None.
    """
    return f"data: {model.model_dump_json(exclude_none=exclude_none)}\n\n"


def sse_error(error: RequestError | ErrorResponse) -> str:
    """An error inside a stream (the 200 is already sent); the official client raises
    ``APIError`` with this message when a ``data`` event carries an ``error`` object. Nulls are
    kept so that the body has the same shape as a non-streamed error."""
    body = error.to_response() if isinstance(error, RequestError) else error
    return sse_event(body, exclude_none=False)
