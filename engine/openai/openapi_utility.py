"""The OpenAPI description of the routes beside generation (``utility_api.py``): the model
card, the tokenizer routes, ``/version`` and ``/load``.

``openapi.py`` merges these paths and schemas into its document; the shared responses
(``BadRequest``, ``ModelNotFound``...) are its ``components.responses``, referred to by name.
The request schemas carry the served bounds the handlers apply: the model's name, token ids
below the vocabulary size, at most one of the two ``/tokenize`` forms.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from corefleet.engine.openai.chat_render import chat_template_rules
from corefleet.engine.openai.openapi_admin import REF_TEMPLATE, Schema, component_ref
from corefleet.engine.openai.tokenize_protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    LoadResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    VersionResponse,
    tokenizer_info_schema,
)

JSON = "application/json"


def utility_schemas(model_name: str, vocab_size: int | None) -> dict[str, Schema]:
    """The component schemas of the utility routes' bodies and answers."""
    requests: list[type[BaseModel]] = [
        TokenizeCompletionRequest,
        TokenizeChatRequest,
        DetokenizeRequest,
    ]
    answers: list[type[BaseModel]] = [
        TokenizeResponse,
        DetokenizeResponse,
        VersionResponse,
        LoadResponse,
    ]
    pairs = [(m, "validation") for m in requests] + [(m, "serialization") for m in answers]
    _, top = models_json_schema(pairs, ref_template=REF_TEMPLATE)  # type: ignore[arg-type]
    schemas: dict[str, Schema] = dict(top.get("$defs", {}))
    model = {"enum": [model_name, None], "default": None, "title": "Model"}
    for name in ("TokenizeCompletionRequest", "TokenizeChatRequest", "DetokenizeRequest"):
        schemas[name]["properties"]["model"] = model
    chat = schemas["TokenizeChatRequest"]
    chat["allOf"] = []
    chat_template_rules(chat)  # the chat endpoint's rules on the same fields
    # A body with "messages" is the chat form: the prompt form is one without it.
    schemas["TokenizeCompletionRequest"]["not"] = {"required": ["messages"]}
    tokens = schemas["DetokenizeRequest"]["properties"]["tokens"]
    if vocab_size is not None:
        tokens["items"]["maximum"] = vocab_size - 1
    for name in ("TokenizeResponse",):  # dumped with nulls kept: every field is present
        schemas[name]["required"] = list(schemas[name]["properties"])
    schemas["TokenizerInfo"] = tokenizer_info_schema()
    return schemas


def _status(name: str) -> Schema:
    return {"$ref": f"#/components/responses/{name}"}


def _ok(description: str, schema: str) -> Schema:
    return {"description": description, "content": {JSON: {"schema": component_ref(schema)}}}


def _op(op_id: str, ok: Schema, auth: bool, protected: bool, **errors: str) -> Schema:
    responses = {"200": ok, "503": _status("Overloaded")}
    responses |= {status: _status(name) for status, name in errors.items()}
    out: Schema = {"operationId": op_id, "summary": ok["description"], "responses": responses}
    if protected and auth:
        out["security"] = [{"bearer": []}]
        responses["401"] = _status("Unauthorized")
    return out


def _posted(op_id: str, ok: Schema, body: Schema, auth: bool, **errors: str) -> Schema:
    errors = {"400": "BadRequest", "404": "ModelNotFound", "408": "RequestTimeout"} | errors
    errors["413"] = "PayloadTooLarge"
    request = {"required": True, "content": {JSON: {"schema": body}}}
    return {"requestBody": request} | _op(op_id, ok, auth, protected=True, **errors)


def utility_paths(auth: bool, tokenizer_info: bool) -> dict[str, Any]:
    """The path items of the utility routes (``/tokenizer_info`` only when it is served)."""
    either = {
        "anyOf": [
            component_ref("TokenizeCompletionRequest"),
            component_ref("TokenizeChatRequest"),
        ]
    }
    tokenize = _ok("The prompt's tokens (chat form: as rendered)", "TokenizeResponse")
    card = _ok("The served model", "ModelCard")
    card_op = _op("retrieveModel", card, auth, protected=True, **{"404": "ModelNotFound"})
    name = {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
    paths: dict[str, Any] = {
        "/v1/models/{model}": {"get": card_op | {"parameters": [name]}},
        "/tokenize": {
            "post": _posted("tokenize", tokenize, either, auth, **{"503": "Unavailable"})
        },
        "/detokenize": {
            "post": _posted(
                "detokenize",
                _ok("The text of the ids", "DetokenizeResponse"),
                component_ref("DetokenizeRequest"),
                auth,
            )
        },
        "/version": {
            "get": _op("version", _ok("corefleet's version", "VersionResponse"), auth, False)
        },
        "/load": {
            "get": _op(
                "load",
                _ok("Requests in flight (--enable-server-load-tracking)", "LoadResponse"),
                auth,
                False,
            )
        },
    }
    if tokenizer_info:
        info = _ok("The tokenizer's configuration", "TokenizerInfo")
        paths["/tokenizer_info"] = {"get": _op("tokenizerInfo", info, auth, protected=True)}
    return paths
