"""Pure helpers of the Kubernetes emulator: selectors, merge patches, schema defaults, time.

Used by `kubeemu.py`. They follow the API server's documented behaviour closely enough for an
operator test: label selectors with `=`, `==`, `!=`, `in`, `notin`, `key`, `!key`; field selectors
on `metadata.name` and `metadata.namespace`; JSON merge patch (RFC 7386); and structural-schema
defaulting (a `default` applies where the field is absent, recursively, after the parent exists).
"""

from __future__ import annotations

import copy
import datetime
import re
from collections.abc import Mapping
from typing import Any

_SET_TERM = re.compile(r"^\s*([\w./-]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


def now_rfc3339() -> str:
    """The current time as the API server writes timestamps."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _terms(selector: str) -> list[str]:
    terms, depth, current = [], 0, ""
    for char in selector:
        depth += (char == "(") - (char == ")")
        if char == "," and depth == 0:
            terms.append(current.strip())
            current = ""
        else:
            current += char
    if current.strip():
        terms.append(current.strip())
    return terms


def _term_matches(labels: Mapping[str, str], term: str) -> bool:
    if match := _SET_TERM.match(term):
        key, op, raw = match.groups()
        values = {v.strip() for v in raw.split(",")}
        return (labels.get(key) in values) if op == "in" else (labels.get(key) not in values)
    if "!=" in term:
        key, value = (s.strip() for s in term.split("!=", 1))
        return labels.get(key) != value
    if "=" in term:
        key, value = (s.strip() for s in term.replace("==", "=").split("=", 1))
        return labels.get(key) == value
    if term.startswith("!"):
        return term[1:].strip() not in labels
    return term in labels


def labels_match(labels: Mapping[str, str], selector: str | None) -> bool:
    """Whether labels satisfy a label-selector string (empty selector: everything)."""
    return not selector or all(_term_matches(labels, t) for t in _terms(selector))


def fields_match(obj: Mapping[str, Any], selector: str | None) -> bool:
    """Whether an object satisfies a field selector on metadata.name / metadata.namespace."""
    if not selector:
        return True
    meta = obj.get("metadata") or {}
    known = {"metadata.name": meta.get("name"), "metadata.namespace": meta.get("namespace")}
    for term in _terms(selector):
        negated = "!=" in term
        key, value = (s.strip() for s in re.split(r"!=|==|=", term, maxsplit=1))
        if (known.get(key) == value) == negated:
            return False
    return True


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: dicts merge, null deletes, anything else replaces."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def apply_defaults(schema: Mapping[str, Any], value: Any) -> Any:
    """Fill `default`s of a structural schema into a value, as the API server does on write."""
    if isinstance(value, dict) and schema.get("type") == "object":
        for key, sub in (schema.get("properties") or {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = apply_defaults(sub, value[key])
        extra = schema.get("additionalProperties")
        if isinstance(extra, Mapping):
            for key in value:
                value[key] = apply_defaults(extra, value[key])
    elif isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        return [apply_defaults(schema["items"], item) for item in value]
    return value


def get_path(obj: Any, dotted: str) -> Any:
    """Value at a `.a.b.c` path (None when any step is absent)."""
    for part in dotted.strip(".").split("."):
        obj = obj.get(part) if isinstance(obj, Mapping) else None
    return obj


def set_path(obj: dict[str, Any], dotted: str, value: Any) -> None:
    """Set the value at a `.a.b.c` path, creating dicts on the way."""
    parts = dotted.strip(".").split(".")
    for part in parts[:-1]:
        obj = obj.setdefault(part, {})
    obj[parts[-1]] = value
