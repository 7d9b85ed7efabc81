"""The constrained-output fields in the OpenAPI document (see ``openapi.py``).

Each field's shape is said. Whether a schema, regex or grammar compiles no JSON Schema can say:
that 400 carries the ``invalid_grammar`` code, one of the document's schema-valid refusals. So
does ``constraint_conflict``: more than one constraint, or one next to ``ignore_eos`` or
``min_tokens``; a JSON Schema could say it, but not one schemathesis still generates from.
"""

from __future__ import annotations

from typing import Any

from corefleet.engine.openai import limits

Schema = dict[str, Any]
_NULL: Schema = {"type": "null"}
_TEXT: Schema = {"type": "string", "maxLength": limits.MAX_GRAMMAR_CHARS}
_CHOICES: Schema = {"type": "array", "items": {"type": "string"}, "minItems": 1}
_JSON_SCHEMA: Schema = {"anyOf": [{"type": "object"}, _TEXT]}
_GUIDED: dict[str, Schema] = {
    "guided_json": _JSON_SCHEMA,
    "guided_regex": _TEXT,
    "guided_choice": _CHOICES,
    "guided_grammar": _TEXT,
}
_STRUCTURED_KINDS: dict[str, Schema] = {
    "json": _JSON_SCHEMA,
    "regex": _TEXT,
    "choice": _CHOICES,
    "grammar": _TEXT,
    "json_object": {"const": True},
    "structural_tag": {"anyOf": [{"type": "object"}, _TEXT]},
}


# vLLM's per-request override of --structured-outputs-config's option (structured_options).
_OPTIONS: dict[str, Schema] = {
    "disable_additional_properties": {
        "type": ["boolean", "null"],
        "description": "true (the server's default unless --structured-outputs-config says "
        "otherwise): a JSON schema's objects allow only the properties they declare, unless "
        "they say additionalProperties; false: any other key is allowed",
    },
}


def _one_key(name: str, value: Schema) -> Schema:
    return {
        "type": "object",
        "properties": {name: value, **_OPTIONS},
        "required": [name],
        "additionalProperties": False,
    }


def _response_format() -> Schema:
    def typed(kind: str, **props: Schema) -> Schema:
        schema: Schema = {"type": "object", "properties": {"type": {"const": kind}, **props}}
        return schema | {"required": ["type", *props]}

    json_schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "schema": {"type": "object"},
            "strict": {"type": ["boolean", "null"]},
        },
    }
    return {
        "description": "text (no constraint), any JSON object, or a JSON schema",
        "anyOf": [
            _NULL,
            typed("text"),
            typed("json_object"),
            typed("json_schema", json_schema=json_schema),
        ],
    }


def structured_output_rules(schema: Schema) -> None:
    """Patch the constrained-output fields and their cross-field rules into ``schema``."""
    props = schema["properties"]
    props["response_format"] = _response_format()
    props["structured_outputs"] = {
        "description": "vLLM's form: exactly one constraint key, and options",
        "anyOf": [_NULL, *(_one_key(k, v) for k, v in _STRUCTURED_KINDS.items())],
    }
    for name, value in _GUIDED.items():
        props[name] = {"anyOf": [_NULL, value], "description": "vLLM's older form"}
    # "At most one of them, and not with ignore_eos or min_tokens" is a 400 with the
    # constraint_conflict code: as an anyOf it made the document too large for schemathesis.
