"""Check InferenceEngine manifests the way the API server would, without one.

The server defaults a manifest from the structural schema, validates it against the schema, then
evaluates the CEL rules (`x-kubernetes-validations`) on the defaulted object. Here: defaulting is
a walk over the schema, the structural check is `jsonschema`'s Draft 4 validator (OpenAPI v3.0
schemas are Draft 4 plus extensions, e.g. boolean `exclusiveMinimum`), and CEL is `cel-python`.
"""

from __future__ import annotations

import copy
import functools
import pathlib
from collections.abc import Iterator, Mapping
from typing import Any

import celpy
import jsonschema
import yaml

CRD_PATH = (
    pathlib.Path(__file__).resolve().parents[3] / "crds" / "inferenceengines.corefleet.dev.yaml"
)
CRD = yaml.safe_load(CRD_PATH.read_text())
VERSION = CRD["spec"]["versions"][0]
SCHEMA = VERSION["schema"]["openAPIV3Schema"]


def defaulted(obj: Any, schema: Mapping[str, Any] = SCHEMA) -> Any:
    """A copy of `obj` with the schema's defaults filled in where fields are absent."""
    obj = copy.deepcopy(obj)
    if isinstance(obj, dict) and schema.get("type") == "object":
        for key, sub in (schema.get("properties") or {}).items():
            if key not in obj and "default" in sub:
                obj[key] = copy.deepcopy(sub["default"])
            if key in obj:
                obj[key] = defaulted(obj[key], sub)
    elif isinstance(obj, list) and isinstance(schema.get("items"), Mapping):
        obj = [defaulted(item, schema["items"]) for item in obj]
    return obj


@functools.cache
def _program(rule: str) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(rule))


def rules(schema: Mapping[str, Any] = SCHEMA) -> Iterator[str]:
    """Every CEL rule in the schema."""
    for rule in schema.get("x-kubernetes-validations") or ():
        yield rule["rule"]
    for sub in (schema.get("properties") or {}).values():
        yield from rules(sub)
    if isinstance(schema.get("items"), Mapping):
        yield from rules(schema["items"])


def _cel_errors(value: Any, schema: Mapping[str, Any], path: str) -> Iterator[str]:
    for rule in schema.get("x-kubernetes-validations") or ():
        result = _program(rule["rule"]).evaluate({"self": celpy.json_to_cel(value)})
        if not isinstance(result, celpy.celtypes.BoolType) or not result:
            yield f"{path}: {rule.get('message', rule['rule'])}"
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key in value:
                yield from _cel_errors(value[key], sub, f"{path}.{key}")
    elif isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for i, item in enumerate(value):
            yield from _cel_errors(item, schema["items"], f"{path}[{i}]")


def errors(manifest: Mapping[str, Any]) -> list[str]:
    """Why the API server would refuse the manifest (empty: it would accept it)."""
    obj = defaulted(manifest)
    found = [e.message for e in jsonschema.Draft4Validator(SCHEMA).iter_errors(obj)]
    return found or list(_cel_errors(obj, SCHEMA, "self"))
