"""The Responses API in the OpenAPI document: ``POST /v1/responses`` (its request from
``responses_models``), ``GET`` and ``DELETE /v1/responses/{response_id}``, the ``response``
object and the streamed events."""

from __future__ import annotations

from pydantic.json_schema import models_json_schema

from corefleet.engine.openai.openapi_admin import (
    POST_ERRORS,
    REF_TEMPLATE,
    Schema,
    component_ref,
)
from corefleet.engine.openai.responses_models import ResponsesRequest

JSON, SSE = "application/json", "text/event-stream"
_STRING, _INT = {"type": "string"}, {"type": "integer"}

_OUTPUT_TEXT: Schema = {
    "type": "object",
    "required": ["type", "text", "annotations"],
    "properties": {
        "type": {"const": "output_text"},
        "text": _STRING,
        "annotations": {"type": "array", "maxItems": 0},
        "logprobs": {"type": "array", "maxItems": 0},
    },
}
_MESSAGE_ITEM: Schema = {
    "type": "object",
    "required": ["type", "id", "status", "role", "content"],
    "properties": {
        "type": {"const": "message"},
        "id": _STRING,
        "status": {"enum": ["in_progress", "completed"]},
        "role": {"const": "assistant"},
        "content": {"type": "array", "items": _OUTPUT_TEXT},
    },
}
_CALL_ITEM: Schema = {
    "type": "object",
    "required": ["type", "id", "call_id", "name", "arguments", "status"],
    "properties": {
        "type": {"const": "function_call"},
        "id": _STRING,
        "call_id": _STRING,
        "name": _STRING,
        "arguments": {"type": "string", "description": "JSON text"},
        "status": {"enum": ["in_progress", "completed"]},
    },
}
_USAGE: Schema = {
    "type": "object",
    "required": ["input_tokens", "output_tokens", "total_tokens"],
    "properties": {
        "input_tokens": _INT,
        "input_tokens_details": {"type": "object", "properties": {"cached_tokens": _INT}},
        "output_tokens": _INT,
        "output_tokens_details": {"type": "object", "properties": {"reasoning_tokens": _INT}},
        "total_tokens": _INT,
    },
}
RESPONSE_OBJECT: Schema = {
    "type": "object",
    "description": "A response. status 'incomplete' (incomplete_details.reason "
    "'max_output_tokens') when the answer was cut short.",
    "required": ["id", "object", "created_at", "status", "model", "output", "usage"],
    "properties": {
        "id": _STRING,
        "object": {"const": "response"},
        "created_at": _INT,
        "status": {"enum": ["completed", "incomplete", "failed", "in_progress"]},
        "error": {"type": ["object", "null"]},
        "incomplete_details": {
            "anyOf": [
                {"type": "null"},
                {"type": "object", "properties": {"reason": {"const": "max_output_tokens"}}},
            ]
        },
        "model": _STRING,
        "output": {"type": "array", "items": {"anyOf": [_MESSAGE_ITEM, _CALL_ITEM]}},
        "previous_response_id": {"type": ["string", "null"]},
        "usage": {"anyOf": [{"type": "null"}, _USAGE]},
    },
}
_EVENT_DATA: Schema = {
    "type": "object",
    "required": ["type", "sequence_number"],
    "properties": {"type": _STRING, "sequence_number": _INT},
}
_EVENT: Schema = {
    "type": "object",
    "description": "A stream event: `event` is its type, `data` its JSON (with the same "
    "`type`); response.created first, response.completed, response.incomplete or "
    "response.failed last (no [DONE]).",
    "required": ["event", "data"],
    "properties": {
        "event": _STRING,
        "data": {
            "type": "string",
            "contentMediaType": JSON,
            "contentSchema": component_ref("ResponseStreamEventData"),
        },
    },
}
_DELETED: Schema = {
    "type": "object",
    "required": ["id", "object", "deleted"],
    "properties": {
        "id": _STRING,
        "object": {"const": "response.deleted"},
        "deleted": {"const": True},
    },
}


def responses_schemas() -> dict[str, Schema]:
    """The components the Responses routes refer to."""
    _, top = models_json_schema([(ResponsesRequest, "validation")], ref_template=REF_TEMPLATE)
    defs: dict[str, Schema] = top.get("$defs", {})
    return defs | {
        "ResponseObject": RESPONSE_OBJECT,
        "ResponseStreamEvent": _EVENT,
        "ResponseStreamEventData": _EVENT_DATA,
        "ResponseDeleted": _DELETED,
    }


def _answers(ok: Schema, auth: bool, errors: dict[str, str]) -> Schema:
    out = {"200": ok} | {s: {"$ref": f"#/components/responses/{n}"} for s, n in errors.items()}
    if auth:
        out["401"] = {"$ref": "#/components/responses/Unauthorized"}
    return out


def responses_paths(auth: bool) -> Schema:
    """``/v1/responses`` and ``/v1/responses/{response_id}``."""
    security: Schema = {"security": [{"bearer": []}]} if auth else {}
    created = {
        "description": "The response (JSON), or its events (text/event-stream) with stream=true",
        "content": {
            JSON: {"schema": component_ref("ResponseObject")},
            SSE: {"schema": component_ref("ResponseStreamEvent")},
        },
    }
    stored = {
        "description": "The stored response",
        "content": {JSON: {"schema": component_ref("ResponseObject")}},
    }
    deleted = {
        "description": "Deleted",
        "content": {JSON: {"schema": component_ref("ResponseDeleted")}},
    }
    parameter = {"name": "response_id", "in": "path", "required": True, "schema": _STRING}
    by_id_errors = {"404": "ResponseNotFound"}
    return {
        "/v1/responses": {
            "post": {
                "operationId": "createResponse",
                "summary": "A response (OpenAI's Responses API), served as a chat completion",
                "requestBody": {
                    "required": True,
                    "content": {JSON: {"schema": component_ref("ResponsesRequest")}},
                },
                "responses": _answers(created, auth, POST_ERRORS),
                **security,
            }
        },
        "/v1/responses/{response_id}": {
            "get": {
                "operationId": "getResponse",
                "summary": "A response stored by this coordinator process",
                "parameters": [parameter],
                "responses": _answers(stored, auth, by_id_errors),
                **security,
            },
            "delete": {
                "operationId": "deleteResponse",
                "summary": "Forget a stored response",
                "parameters": [parameter],
                "responses": _answers(deleted, auth, by_id_errors),
                **security,
            },
        },
    }
