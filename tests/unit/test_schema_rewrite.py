"""The JSON Schema rewrites made before a schema becomes a grammar (``schema_rewrite``)."""

from __future__ import annotations

import copy
import json
from typing import Any

import jsonschema
import pytest

from corefleet.engine.structured_output.schema_rewrite import close_objects, relocate

OBJ = {"type": "object", "properties": {"a": {"type": "integer"}}}


def test_close_objects_closes_every_declaring_object_and_nothing_else() -> None:
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {
            "nested": OBJ,
            "list": {"type": "array", "items": OBJ},
            "either": {"anyOf": [OBJ, {"type": "string"}]},
            "free": {"type": "object"},  # declares nothing: any object, as json_object
            "open": OBJ | {"additionalProperties": True},  # explicit: honoured
            "typed": OBJ | {"additionalProperties": OBJ},  # explicit, itself closed
            "pattern": {"type": "object", "patternProperties": {"^x": {"type": "integer"}}},
            "ref": {"$ref": "#/$defs/D"},
            # A property named like a keyword, and a const that looks like a schema.
            "properties": {"const": {"properties": {"k": 1}}},
        },
        "$defs": {"D": OBJ},
    }
    before = copy.deepcopy(schema)
    closed = close_objects(schema)
    assert schema == before  # a copy: the request's schema is not changed
    good = {
        "nested": {"a": 1},
        "list": [{"a": 2}],
        "either": {"a": 3},
        "free": {"anything": 1},
        "open": {"a": 1, "b": 2},
        "typed": {"a": 1, "b": {"a": 2}},
        "pattern": {"x1": 1},
        "ref": {"a": 1},
        "properties": {"properties": {"k": 1}},
    }
    jsonschema.validate(good, closed)
    for key, wrong in [
        ("nested", {"a": 1, "b": 2}),
        ("list", [{"a": 2, "b": 3}]),
        ("either", {"a": 3, "b": 4}),
        ("typed", {"a": 1, "b": {"a": 2, "c": 3}}),
        ("pattern", {"y": 1}),
        ("ref", {"a": 1, "b": 2}),
    ]:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(good | {key: wrong}, closed)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good | {"invented": 1}, closed)
    assert closed["properties"]["properties"] == {"const": {"properties": {"k": 1}}}
    assert "additionalProperties" not in closed["properties"]["free"]


def test_close_objects_fails_cleanly_on_absurd_depth() -> None:
    deep: dict[str, Any] = {"type": "object", "properties": {}}
    for _ in range(100_000):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(RecursionError):
        close_objects(deep)


def test_relocate_hoists_definitions_and_rewrites_refs() -> None:
    schema = {
        "type": "object",
        "properties": {
            "a": {"$ref": "#/$defs/A"},
            "b": {"$ref": "#/definitions/A"},
            "self": {"$ref": "#/properties/c"},
            "c": {"type": "integer"},
            "remote": {"$ref": "https://example.com/s.json"},
            "slash": {"$ref": "#/$defs/x~1y"},
        },
        "$defs": {"A": {"type": "string"}, "x/y": {"$ref": "#/$defs/A"}},
        "definitions": {"A": {"type": "boolean"}},
    }
    before = json.dumps(schema)
    body, defs = relocate(schema, "f", "/properties/at")
    assert json.dumps(schema) == before
    assert set(defs) == {"f.A", "f.x/y", "f:A"}  # $defs and definitions kept apart
    props = body["properties"]
    assert props["a"] == {"$ref": "#/$defs/f.A"} and props["b"] == {"$ref": "#/$defs/f:A"}
    assert props["self"] == {"$ref": "#/properties/at/properties/c"}
    assert props["remote"] == {"$ref": "https://example.com/s.json"}
    assert props["slash"] == {"$ref": "#/$defs/f.x~1y"}
    assert defs["f.x/y"] == {"$ref": "#/$defs/f.A"}
    document = {"type": "object", "properties": {"at": body}, "$defs": defs}
    jsonschema.validate({"at": {"a": "s", "b": True, "self": 1, "c": 2, "slash": "t"}}, document)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"at": {"b": "not a boolean"}}, document)
