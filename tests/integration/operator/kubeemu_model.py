"""Pure helpers of the Kubernetes emulator: selectors, merge patches, schema defaults, time.

Used by `kubeemu.py`. They follow the API server's documented behaviour closely enough for an
operator test: label selectors with `=`, `==`, `!=`, `in`, `notin`, `key`, `!key`; field selectors
with `=`, `==`, `!=` on any field path (`metadata.name`, `spec.nodeName`, `status.phase`; a
missing field reads as "", so `spec.nodeName=` selects unscheduled pods; the real server allows
only a few fields per resource); JSON merge patch (RFC 7386); a strategic merge patch good
enough for what `kubectl apply` sends for built-in kinds (lists of known kinds merged by their
merge key, `$patch`, `$retainKeys`, `$setElementOrder`, `$deleteFromPrimitiveList`); and
structural-schema defaulting (a `default` applies where the field is absent, recursively, after
the parent exists).
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


def _field_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def fields_match(obj: Mapping[str, Any], selector: str | None) -> bool:
    """Whether an object satisfies a field selector; ValueError for a malformed one."""
    if not selector:
        return True
    for term in _terms(selector):
        parts = re.split(r"(!=|==|=)", term, maxsplit=1)
        if len(parts) != 3 or not parts[0].strip():
            raise ValueError(f"invalid field selector term {term!r}")
        key, op, value = (p.strip() for p in parts)
        if (_field_text(get_path(obj, key)) == value) == (op == "!="):
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


MERGE_KEYS = {  # list fields of built-in kinds that a strategic merge patch merges by a key
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "volumes": "name",
    "env": "name",
    "imagePullSecrets": "name",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
    "ports": "containerPort|port",
    "conditions": "type",
    "ownerReferences": "uid",
    "topologySpreadConstraints": "topologyKey",
    "hostAliases": "ip",
}
PRIMITIVE_MERGE_LISTS = {"finalizers"}


def _merge_key(field: str, items: list[Any]) -> str | None:
    for key in MERGE_KEYS.get(field, "").split("|"):
        if key and all(isinstance(i, Mapping) and key in i for i in items):
            return key
    return None


def _merge_list(field: str, target: Any, patch: list[Any]) -> list[Any]:
    current = list(target) if isinstance(target, list) else []
    if field in PRIMITIVE_MERGE_LISTS:
        return current + [v for v in patch if v not in current]
    key = _merge_key(field, current + patch)
    if key is None:
        return [strategic_merge(None, item) for item in patch]
    for item in patch:
        index = next((i for i, c in enumerate(current) if c.get(key) == item[key]), None)
        if item.get("$patch") == "delete":
            current = [c for c in current if c.get(key) != item[key]]
        elif index is None:
            current.append(strategic_merge(None, item))
        else:
            current[index] = strategic_merge(current[index], item)
    return current


def strategic_merge(target: Any, patch: Any) -> Any:
    """A strategic merge patch as kubectl apply sends for built-in kinds (see module doc)."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    directive = patch.get("$patch")
    if directive == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    if directive == "delete":
        return None
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if key.startswith("$setElementOrder/") or key in ("$patch", "$retainKeys"):
            continue
        if key.startswith("$deleteFromPrimitiveList/"):
            field = key.split("/", 1)[1]
            result[field] = [v for v in result.get(field) or [] if v not in value]
        elif value is None:
            result.pop(key, None)
        elif isinstance(value, list):
            result[key] = _merge_list(key, result.get(key), value)
        else:
            merged = strategic_merge(result.get(key), value)
            if merged is None:
                result.pop(key, None)
            else:
                result[key] = merged
    if isinstance(patch.get("$retainKeys"), list):
        result = {k: v for k, v in result.items() if k in patch["$retainKeys"]}
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


def apply_kind_defaults(
    schema: Mapping[str, Any] | None, fields: Mapping[str, Any], obj: dict[str, Any]
) -> None:
    """Default an object on write: its CRD schema's defaults, or a built-in kind's `fields`
    (a RollingUpdate strategy also gets its 25% surge and unavailability where unset)."""
    if schema is not None:
        apply_defaults(schema, obj)
    for dotted, value in fields.items():
        if get_path(obj, dotted) is None:
            set_path(obj, dotted, copy.deepcopy(value))
    if "strategy" in fields_parents(fields) and get_path(obj, ".spec.strategy.type") == (
        "RollingUpdate"
    ):
        for key in ("maxUnavailable", "maxSurge"):
            if get_path(obj, f".spec.strategy.rollingUpdate.{key}") is None:
                set_path(obj, f".spec.strategy.rollingUpdate.{key}", "25%")


def fields_parents(fields: Mapping[str, Any]) -> set[str]:
    """The second-level names of dotted default paths (`.spec.strategy.type` -> strategy)."""
    return {path.strip(".").split(".")[1] for path in fields if path.count(".") >= 2}


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
