"""The OpenAPI 3.1 document of the HTTP API (``GET /openapi.json``), written out, not inferred.

The handlers read raw bodies (to word their own errors), so FastAPI's routes say nothing of what
they take or answer. :func:`openapi_document` says it: request bodies and responses from the
pydantic models (a stream is ``text/event-stream``, one schema per event), every error status
with OpenAI's error body, ``/metrics`` as text, the bearer scheme when API keys are on.

A request the schema accepts is one the server accepts, but for what no JSON Schema can say (a
prompt's length in tokens, ``min_tokens`` against ``max_tokens``): those 400s carry a ``code``
of :data:`~corefleet.engine.openai.errors.SCHEMA_VALID_REFUSALS`, listed in the document. The
rest is in the schema: the served ranks' bounds (``n`` × prompts, ``max_model_len``, token ids
below ``vocab_size``, the model's name) and the cross-field rules, such as ``stream_options``
only with ``stream`` (an ``anyOf`` each: fuzzers expand ``if``/``then`` into far more cases).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from importlib import metadata
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaMode, models_json_schema

from corefleet.engine.coordinator.membership import RankMember
from corefleet.engine.openai import protocol as p
from corefleet.engine.openai.errors import SCHEMA_VALID_REFUSALS, ErrorResponse
from corefleet.engine.openai.limits import RequestLimits
from corefleet.engine.openai.openapi_admin import REF_TEMPLATE, Schema, hand_written_schemas
from corefleet.engine.openai.openapi_admin import component_ref as _ref
from corefleet.engine.openai.openapi_pooling import pooling_document
from corefleet.engine.openai.openapi_requests import (
    NULL,
    chat_rules,
    completion_rules,
    sampling_rules,
)
from corefleet.engine.openai.openapi_responses import responses_paths, responses_schemas
from corefleet.engine.openai.openapi_utility import utility_paths, utility_schemas

__all__ = ["openapi_document", "served_openapi"]

JSON, SSE, TEXT = "application/json", "text/event-stream", "text/plain"
try:
    _VERSION = metadata.version("corefleet")
except metadata.PackageNotFoundError:  # pragma: no cover - not installed
    _VERSION = "0"


class _AllFieldsRequired(GenerateJsonSchema):
    """Serialization schemas with every field required: responses are dumped with nulls kept."""

    def field_is_required(self, field: Any, total: bool) -> bool:
        return self.mode == "serialization" or super().field_is_required(field, total)


def _schemas(models: Sequence[type[BaseModel]], mode: JsonSchemaMode) -> dict[str, Schema]:
    _, top = models_json_schema(
        [(m, mode) for m in models], ref_template=REF_TEMPLATE, schema_generator=_AllFieldsRequired
    )
    return dict(top.get("$defs", {}))


def _map(schema: Any, fn: Callable[[Schema], Schema]) -> Any:
    """``schema`` with ``fn`` applied to each object in it, innermost first."""
    if isinstance(schema, list):
        return [_map(s, fn) for s in schema]
    return fn({k: _map(v, fn) for k, v in schema.items()}) if isinstance(schema, dict) else schema


def _streamed(schema: Schema) -> Schema:
    """A model's schema as ``exclude_none`` dumps it: a nullable field is absent, never null."""
    for name, prop in schema.get("properties", {}).items():
        if NULL in prop.get("anyOf", []):
            rest = [b for b in prop["anyOf"] if b != NULL]
            kept = {k: v for k, v in prop.items() if k not in ("anyOf", "default")}
            schema["properties"][name] = kept | (rest[0] if len(rest) == 1 else {"anyOf": rest})
            schema["required"] = [r for r in schema.get("required", []) if r != name]
    return schema


def _stream_schemas(responses: dict[str, Schema]) -> dict[str, Schema]:
    """The stream chunks' schemas; a model whose streamed form differs from its whole-response
    form (or refers to one that does) is named ``Streamed<Name>``."""
    models: list[type[BaseModel]] = [p.CompletionStreamResponse, p.ChatCompletionChunk]
    chunks = _map(_schemas(models, "serialization"), _streamed)
    names: set[str] = set()

    def renamed(schema: Schema) -> Schema:
        target = schema.get("$ref", "").rpartition("/")[2]
        return _ref(f"Streamed{target}") if target in names else schema

    while True:
        current = {n: _map(s, renamed) for n, s in chunks.items()}
        differ = {n for n, s in current.items() if n in responses and s != responses[n]}
        if differ <= names:
            return {(f"Streamed{n}" if n in names else n): s for n, s in current.items()}
        names |= differ


_TEXT: Schema = {"schema": {"type": "string"}}
_OVERLOADED = "uvicorn's plain-text 'Service Unavailable': more connections than --max-connections"


def _error(description: str, *, text: bool = False, retry: bool | None = None) -> Schema:
    """A response with OpenAI's error body (and uvicorn's plain text when ``text``); with a
    ``Retry-After`` header, required when ``retry`` is True."""
    content = {JSON: {"schema": _ref("ErrorResponse")}} | ({TEXT: _TEXT} if text else {})
    out: Schema = {"description": description, "content": content}
    if retry is not None:
        seconds = {"type": "integer", "minimum": 0}
        header = {"description": "seconds to wait before retrying", "schema": seconds}
        out["headers"] = {"Retry-After": header | {"required": retry}}
    return out


def _responses(limits: RequestLimits) -> dict[str, Schema]:
    """The shared responses, by name."""
    return {
        "BadRequest": _error(
            "The request is malformed or out of range; `param` names the field. A request "
            f"this document accepts is refused only {_REFUSALS}"
        ),
        "Unauthorized": _error("No `Authorization: Bearer KEY` header with a configured key"),
        "ModelNotFound": _error("`model` is not the served model (code `model_not_found`)"),
        "RequestTimeout": _error(
            f"The body did not arrive within {limits.body_timeout_s:g} s (--body-timeout)"
        ),
        "PayloadTooLarge": _error(
            f"The body is over {limits.max_request_body_bytes} bytes (--max-request-body-bytes)"
        ),
        "TooManyRequests": _error(
            "Too many completions in flight, server-wide or for this API key", retry=True
        ),
        "Unavailable": _error(f"No rank is ready yet, or {_OVERLOADED}", text=True, retry=False),
        "Overloaded": {"description": _OVERLOADED, "content": {TEXT: _TEXT}},
    }


_REFUSALS = "with a 400 whose `error.code` is one of these, for what no JSON Schema can say: " + (
    "; ".join(f"`{code}`: {why}" for code, why in SCHEMA_VALID_REFUSALS.items())
)


def _operation(op_id: str, ok: Schema, *, protected: bool, auth: bool, **errors: str) -> Schema:
    """An operation answering ``ok`` (200) or ``errors`` (status -> shared response name); 401
    and the bearer scheme when ``protected`` and API keys are on; 503 always (uvicorn's)."""
    responses = {"200": ok, "503": _status("Overloaded")}
    responses |= {status: _status(name) for status, name in errors.items()}
    out: Schema = {"operationId": op_id, "summary": ok["description"], "responses": responses}
    if protected and auth:
        out["security"] = [{"bearer": []}]
        responses["401"] = _status("Unauthorized")
    return out


def _status(name: str) -> Schema:
    return {"$ref": f"#/components/responses/{name}"}


def _generation(op_id: str, name: str, auth: bool) -> Schema:
    """``POST`` of a ``<name>Request``, answering a ``<name>Response`` or ``<name>Event``s."""
    content = {JSON: {"schema": _ref(f"{name}Response")}, SSE: {"schema": _ref(f"{name}Event")}}
    ok = {"description": f"A {name}, or server-sent events with `stream`", "content": content}
    errors = {"400": "BadRequest", "404": "ModelNotFound", "408": "RequestTimeout"}
    errors |= {"413": "PayloadTooLarge", "429": "TooManyRequests", "503": "Unavailable"}
    body = {"required": True, "content": {JSON: {"schema": _ref(f"{name}Request")}}}
    return {"requestBody": body} | _operation(op_id, ok, protected=True, auth=auth, **errors)


def _json(description: str, schema: Schema) -> Schema:
    return {"description": description, "content": {JSON: {"schema": schema}}}


def _paths(auth: bool) -> Schema:
    op = functools.partial(_operation, auth=auth)
    ready = _json("Ready (200) or not (503)", _ref("Readiness"))
    ready_op = op("ready", ready, protected=False)
    ready_op["responses"]["503"] = ready | {"content": ready["content"] | {TEXT: _TEXT}}
    models = _json("The served model", _ref("ModelList"))
    engines = {"type": "array", "items": _ref("RankStatus")}
    return {
        "/v1/completions": {"post": _generation("createCompletion", "Completion", auth)},
        "/v1/chat/completions": {
            "post": _generation("createChatCompletion", "ChatCompletion", auth)
        },
        "/v1/models": {"get": op("listModels", models, protected=True)},
        "/health": {"get": op("health", _json("It works", _ref("Health")), protected=False)},
        "/ready": {"get": ready_op},
        "/metrics": {
            "get": op(
                "metrics", {"description": "Prometheus", "content": {TEXT: _TEXT}}, protected=False
            )
        },
        "/admin/engines": {"get": op("listEngines", _json("The ranks", engines), protected=True)},
    }


@functools.lru_cache(maxsize=32)
def openapi_document(
    model_name: str,
    *,
    auth: bool,
    max_n: int,
    max_model_len: int | None = None,
    vocab_size: int | None = None,
    limits: RequestLimits | None = None,
    tokenizer_info: bool = False,
    max_logprobs: int | None = None,
    priority_scheduling: bool = False,
) -> dict[str, Any]:
    """The API's OpenAPI 3.1 document, for these values (cached: treat it as read-only).

    Args:
        model_name: the served model's name, the only ``model`` a request may name.
        auth: API keys are on: ``/v1/*`` and ``/admin/*`` need ``Authorization: Bearer KEY``.
        max_n: the most completions one request may ask for (``n`` × prompts).
        max_model_len, vocab_size: the ranks' context length and vocabulary; None while no
            rank is ready (the bounds that depend on them are then left out).
        limits: the request limits, for the 408 and 413 descriptions.
        tokenizer_info: ``GET /tokenizer_info`` is served (--enable-tokenizer-info-endpoint).
        max_logprobs: the ranks' ``--max-logprobs`` (-1 resolved); None while no rank is ready.
        priority_scheduling: the ranks schedule by ``priority`` (else only 0 is accepted).
    """
    requests = _schemas([p.CompletionRequest, p.ChatCompletionRequest], "validation")
    models: list[type[BaseModel]] = [p.CompletionResponse, p.ChatCompletionResponse, p.ModelList]
    responses = _schemas([*models, ErrorResponse], "serialization")
    # Left out, not null, unless --enable-prompt-tokens-details reports a hit (as vLLM).
    responses["UsageInfo"]["required"].remove("prompt_tokens_details")
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        sampling_rules(
            requests[name],
            model_name,
            max_n,
            max_model_len,
            vocab_size,
            max_logprobs,
            priority_scheduling,
        )
    completion_rules(requests["CompletionRequest"], max_n, max_model_len, vocab_size)
    chat_rules(requests["ChatCompletionRequest"], requests["ChatMessage"])
    # The utility routes' schemas first: they share ChatMessage (and its tools) with the chat
    # request, whose patched form must win.
    utility = utility_schemas(model_name, vocab_size)
    schemas = utility | requests | responses | _stream_schemas(responses) | hand_written_schemas()
    schemas |= responses_schemas()
    answers = _responses(limits or RequestLimits())
    answers["ResponseNotFound"] = _error(
        "No response with this id is stored by this coordinator process (code `response_not_found`)"
    )
    components = {"schemas": schemas, "responses": answers}
    if auth:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    description = (
        f"The OpenAI-compatible API of corefleet, serving `{model_name}`. Errors are OpenAI's "
        '`{"error": {"message", "type", "param", "code"}}`. A request valid under this '
        f"document is accepted, or refused {_REFUSALS}."
    )
    info = {"title": "corefleet", "version": _VERSION, "description": description}
    paths = _paths(auth) | utility_paths(auth, tokenizer_info) | responses_paths(auth)
    return {"openapi": "3.1.0", "info": info, "paths": paths, "components": components}


def served_openapi(
    model_name: str,
    auth: bool,
    max_n: int,
    limits: RequestLimits,
    ranks: Sequence[RankMember],
    tokenizer_info: bool = False,
) -> dict[str, Any]:
    """:func:`openapi_document` for the ranks serving now (the first's context and vocabulary,
    as the handlers use)."""
    info = ranks[0].info if ranks else None
    document = openapi_document(
        model_name,
        auth=auth,
        max_n=max_n,
        max_model_len=info.max_model_len if info else None,
        vocab_size=info.vocab_size if info else None,
        max_logprobs=info.max_logprobs if info else None,
        priority_scheduling=info is not None and info.scheduling_policy == "priority",
        limits=limits,
        tokenizer_info=tokenizer_info,
    )
    if info is not None and info.pooler is not None:  # --runner pooling
        return pooling_document(document, auth)
    return document
