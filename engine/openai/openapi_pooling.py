"""The OpenAPI document of a ``--runner pooling`` server: the generating server's, with
``POST /v1/embeddings`` and ``POST /pooling`` (``pooling_protocol``'s models) in place of the
generation routes, which such a server answers with a 404."""

from __future__ import annotations

from typing import Any

from pydantic.json_schema import models_json_schema

from corefleet.engine.openai.openapi_admin import (
    POST_ERRORS,
    REF_TEMPLATE,
    Schema,
    component_ref,
)
from corefleet.engine.openai.pooling_protocol import (
    EmbeddingResponse,
    PoolingRequest,
    PoolingResponse,
)

JSON = "application/json"
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


def _operation(op_id: str, response: str, summary: str, auth: bool) -> Schema:
    ok = {"description": summary, "content": {JSON: {"schema": component_ref(response)}}}
    responses = {"200": ok} | {
        status: {"$ref": f"#/components/responses/{name}"} for status, name in POST_ERRORS.items()
    }
    body = {"required": True, "content": {JSON: {"schema": component_ref("PoolingRequest")}}}
    out: Schema = {
        "operationId": op_id,
        "summary": summary,
        "requestBody": body,
        "responses": responses,
    }
    if auth:
        out["security"] = [{"bearer": []}]
        responses["401"] = {"$ref": "#/components/responses/Unauthorized"}
    return out


def pooling_document(document: dict[str, Any], auth: bool) -> dict[str, Any]:
    """``document`` (a generating server's, not modified: it is cached) as a pooling server's."""
    _, requests = models_json_schema([(PoolingRequest, "validation")], ref_template=REF_TEMPLATE)
    _, answers = models_json_schema(
        [(EmbeddingResponse, "serialization"), (PoolingResponse, "serialization")],
        ref_template=REF_TEMPLATE,
    )
    schemas = dict(document["components"]["schemas"])
    schemas |= requests.get("$defs", {}) | answers.get("$defs", {})
    paths = {p: v for p, v in document["paths"].items() if p not in GENERATION_PATHS}
    paths["/v1/embeddings"] = {
        "post": _operation("createEmbedding", "EmbeddingResponse", "Embeddings", auth)
    }
    paths["/pooling"] = {
        "post": _operation("createPooling", "PoolingResponse", "Pooled vectors", auth)
    }
    components = dict(document["components"]) | {"schemas": schemas}
    return dict(document) | {"paths": paths, "components": components}
