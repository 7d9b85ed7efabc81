"""Custom resources as the API server checks them: pruning, schema, scale and CEL validation.

Used by `kubeemu.KubeEmu` for objects of a CRD's kind, with the real server's order and words
(`test_kubeemu_differential.py` compares them with kube-apiserver v1.36's):
- pruning: fields the structural schema does not declare are dropped (unless
  `x-kubernetes-preserve-unknown-fields` or `additionalProperties` keep them); the root
  `metadata` keeps only ObjectMeta's fields;
- `metadata.name`: required (unless generateName), a DNS-1123 subdomain;
- the schema (what kube-openapi checks): type, required, enum, minimum/maximum (exclusive too),
  minLength/maxLength, pattern, minItems/maxItems, each as `field.Error` with kube-openapi's
  "in body should ..." detail, properties in name order;
- the scale subresource's `specReplicasPath`: a non-negative integer;
- the CEL rules (`x-kubernetes-validations`, evaluated with cel-python): each failed rule is an
  error at its path (plus `fieldPath`) with its `message`. An error that leaves the object unsafe
  for CEL (Required, NotSupported, TypeInvalid, TooLong, TooMany) skips them, with the real
  server's "some validation rules were not checked" error instead.
`invalid()` turns the errors into the 422 `Status` (message, details.causes). Not emulated:
transition rules (`oldSelf`), ratcheting of unchanged invalid fields on update,
messageExpression, formats, CEL cost limits.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs
import celpy
from kubeemu_request import StatusError

OMIT = object()  # an error that shows no value
REASONS = {
    "Invalid": "FieldValueInvalid",
    "TypeInvalid": "FieldValueTypeInvalid",
    "Required": "FieldValueRequired",
    "NotSupported": "FieldValueNotSupported",
    "Forbidden": "FieldValueForbidden",
    "TooLong": "FieldValueTooLong",
    "TooMany": "FieldValueTooMany",
}
BLOCKING = {"Required", "NotSupported", "TypeInvalid", "TooLong", "TooMany"}
NOT_CHECKED = (
    "some validation rules were not checked because the object was invalid; correct the "
    "existing errors to complete validation"
)
OBJECT_META = {
    "name",
    "generateName",
    "namespace",
    "uid",
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "labels",
    "annotations",
    "ownerReferences",
    "finalizers",
    "managedFields",
}
SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
SUBDOMAIN_TEXT = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or "
    "'.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used "
    "for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
)
JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string"}
GO_TYPES = {bool: "bool", int: "int64", float: "float64", str: "string"}


def _text(value: Any) -> str:
    """A value as Go's field.Error prints it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return f"{value:g}" if isinstance(value, float) else str(value)
    return json.dumps(value, separators=(",", ":"))


@attrs.frozen
class FieldError:
    """One `field.Error` of the API server."""

    type: str
    field: str | None
    value: Any = OMIT
    detail: str = ""
    supported: Sequence[Any] = ()

    def body(self) -> str:
        if self.type == "Required":
            text = "Required value"
        elif self.type == "Forbidden":
            text = "Forbidden"
        elif self.type == "NotSupported":
            text = f"Unsupported value: {_text(self.value)}"
            if self.supported:
                text += ": supported values: " + ", ".join(_text(v) for v in self.supported)
        elif self.type == "TooMany":
            text = f"Too many: {_text(self.value)}"
        elif self.type == "TooLong":
            text = "Too long"
        else:
            text = "Invalid value" + ("" if self.value is OMIT else f": {_text(self.value)}")
        return f"{text}: {self.detail}" if self.detail else text

    def __str__(self) -> str:
        return f"{self.field or '<nil>'}: {self.body()}"

    def cause(self) -> dict[str, str]:
        return {
            "reason": REASONS[self.type],
            "message": self.body(),
            "field": self.field or "<nil>",
        }


def invalid(
    kind: str, name: str, errors: Sequence[FieldError], details: Mapping[str, Any]
) -> StatusError:
    """422 Invalid: `<kind> "<name>" is invalid: <error or [errors]>` with the causes (the
    message names each error once, as Go's error aggregate does)."""
    unique = list(dict.fromkeys(map(str, errors)))
    text = unique[0] if len(unique) == 1 else "[" + ", ".join(unique) + "]"
    info = {**({"name": name} if name else {}), **details}
    info["causes"] = [e.cause() for e in errors]
    return StatusError(422, "Invalid", f'{kind} "{name}" is invalid: {text}', info)


def name_errors(meta: Mapping[str, Any]) -> list[FieldError]:
    """metadata.name: required (unless generateName), a DNS-1123 subdomain."""
    name = meta.get("name")
    if not name:
        if meta.get("generateName"):
            return []
        return [FieldError("Required", "metadata.name", detail="name or generateName is required")]
    if not isinstance(name, str) or len(name) > 253 or not SUBDOMAIN.match(name):
        return [FieldError("Invalid", "metadata.name", name, SUBDOMAIN_TEXT)]
    return []


def prune(schema: Mapping[str, Any] | None, value: Any, root: bool = False) -> Any:
    """`value` less what the structural schema does not declare."""
    if schema is None:
        return value
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        keep_unknown = schema.get("x-kubernetes-preserve-unknown-fields") or extra is True
        out = {}
        for key, item in value.items():
            if root and key in ("apiVersion", "kind"):
                out[key] = item
            elif root and key == "metadata" and isinstance(item, dict):
                out[key] = {k: v for k, v in item.items() if k in OBJECT_META}
            elif key in props:
                out[key] = prune(props[key], item)
            elif isinstance(extra, Mapping):
                out[key] = prune(extra, item)
            elif keep_unknown:
                out[key] = item
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        return [prune(schema["items"], item) for item in value]
    return value


def _type_of(value: Any) -> str:
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "array"
    return JSON_TYPES.get(type(value), "null")


def _type_ok(want: str, value: Any) -> bool:
    have = _type_of(value)
    return have == want or (want == "number" and have == "integer")


def schema_errors(schema: Mapping[str, Any], value: Any, path: str) -> Iterator[FieldError]:
    """What kube-openapi's validator finds (see the module docstring)."""
    where = path or "<nil>"
    if value is None:
        if not schema.get("nullable") and schema.get("type"):
            yield FieldError(
                "TypeInvalid",
                path,
                "null",
                f'{where} in body must be of type {schema["type"]}: "null"',
            )
        return
    want = schema.get("type")
    if schema.get("x-kubernetes-int-or-string"):
        if not isinstance(value, (int, str)) or isinstance(value, bool):
            yield FieldError(
                "TypeInvalid",
                path,
                _type_of(value),
                f'{where} in body must be of type integer or string: "{_type_of(value)}"',
            )
        return
    if want and not _type_ok(want, value):
        have = _type_of(value)
        detail = f'{where} in body must be of type {want}: "{have}"'
        yield FieldError("TypeInvalid", path, have, detail)
        return
    yield from _constraints(schema, value, path, where)
    if isinstance(value, dict):
        for key in sorted(schema.get("required") or ()):
            if key not in value:
                yield FieldError("Required", f"{path}.{key}" if path else key)
        props, extra = schema.get("properties") or {}, schema.get("additionalProperties")
        for key in sorted(value):
            sub = props.get(key, extra if isinstance(extra, Mapping) else None)
            if sub is not None:
                yield from schema_errors(sub, value[key], f"{path}.{key}" if path else key)
    elif isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for i, item in enumerate(value):
            yield from schema_errors(schema["items"], item, f"{path}[{i}]")


def _constraints(
    schema: Mapping[str, Any], value: Any, path: str, where: str
) -> Iterator[FieldError]:
    if "enum" in schema and value not in schema["enum"]:
        yield FieldError("NotSupported", path, value, supported=schema["enum"])
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        low, high = schema.get("minimum"), schema.get("maximum")
        if low is not None and (value <= low if schema.get("exclusiveMinimum") else value < low):
            words = "greater than" if schema.get("exclusiveMinimum") else "greater than or equal to"
            yield FieldError("Invalid", path, value, f"{where} in body should be {words} {low}")
        if high is not None and (value >= high if schema.get("exclusiveMaximum") else value > high):
            words = "less than" if schema.get("exclusiveMaximum") else "less than or equal to"
            yield FieldError("Invalid", path, value, f"{where} in body should be {words} {high}")
    if isinstance(value, str):
        if "minLength" in schema and len(value) < schema["minLength"]:
            detail = f"{where} in body should be at least {schema['minLength']} chars long"
            yield FieldError("Invalid", path, value, detail)
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            detail = f"may not be more than {schema['maxLength']} bytes"
            yield FieldError("TooLong", path, detail=detail)
        if "pattern" in schema and not re.search(schema["pattern"], value):
            detail = f"{where} in body should match '{schema['pattern']}'"
            yield FieldError("Invalid", path, value, detail)
    if isinstance(value, list):
        if "minItems" in schema and len(value) < schema["minItems"]:
            detail = f"{where} in body should have at least {schema['minItems']} items"
            yield FieldError("Invalid", path, value, detail)
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            detail = f"must have at most {schema['maxItems']} items"
            yield FieldError("TooMany", path, len(value), detail)


def scale_errors(obj: Mapping[str, Any], replicas_path: str | None) -> list[FieldError]:
    """The scale subresource's check of the spec's replicas field."""
    if not replicas_path:
        return []
    value: Any = obj
    for part in replicas_path.strip(".").split("."):
        if not isinstance(value, Mapping) or part not in value:
            return []
        value = value[part]
    if not isinstance(value, int) or isinstance(value, bool):
        detail = (
            f"{replicas_path} accessor error: {value} is of the type "
            f"{GO_TYPES.get(type(value), type(value).__name__)}, expected int64"
        )
        return [FieldError("Invalid", replicas_path, 0, detail)]
    if value < 0:
        return [FieldError("Invalid", replicas_path, value, "should be a non-negative integer")]
    return []


@functools.cache
def _program(rule: str) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(rule))


def cel_errors(schema: Mapping[str, Any], value: Any, path: str) -> Iterator[FieldError]:
    """The failed `x-kubernetes-validations` rules, the node's own before its children's."""
    if value is None:
        return
    for rule in schema.get("x-kubernetes-validations") or ():
        subject = value
        if not path and isinstance(value, dict):  # the root: metadata has name/generateName only
            meta = {
                k: v
                for k, v in (value.get("metadata") or {}).items()
                if k in ("name", "generateName")
            }
            subject = {**value, "metadata": meta}
        try:
            ok = bool(_program(rule["rule"]).evaluate({"self": celpy.json_to_cel(subject)}))
        except Exception:  # an evaluation error fails the rule
            ok = False
        if not ok:
            field = path + rule.get("fieldPath", "")
            kind = {v: k for k, v in REASONS.items()}.get(rule.get("reason", ""), "Invalid")
            message = rule.get("message") or f"failed rule: {rule['rule']}"
            yield FieldError(kind, field.lstrip(".") or None, detail=message)
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        for key in sorted(value):
            if key in props:
                yield from cel_errors(props[key], value[key], f"{path}.{key}" if path else key)
    elif isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for i, item in enumerate(value):
            yield from cel_errors(schema["items"], item, f"{path}[{i}]")


def custom_errors(
    schema: Mapping[str, Any] | None, obj: Mapping[str, Any], replicas_path: str | None
) -> list[FieldError]:
    """Everything the real server finds wrong with a custom resource, in its order."""
    errors = name_errors(obj.get("metadata") or {})
    if schema is None:
        return errors
    body = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata")}
    required = [k for k in schema.get("required") or () if k not in ("apiVersion", "kind")]
    errors += schema_errors(
        {**schema, "required": [k for k in required if k != "metadata"]}, body, ""
    )
    errors += scale_errors(obj, replicas_path)
    if _has_rules(schema):
        if any(e.type in BLOCKING for e in errors):
            errors.append(FieldError("Invalid", None, None, NOT_CHECKED))
        else:
            errors += cel_errors(schema, obj, "")
    return errors


@functools.cache
def _rules_in(schema_json: str) -> bool:
    return "x-kubernetes-validations" in schema_json


def _has_rules(schema: Mapping[str, Any]) -> bool:
    return _rules_in(json.dumps(schema, sort_keys=True))
