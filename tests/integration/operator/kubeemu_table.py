"""Server-side printing: the `meta.k8s.io/v1` Tables kube-apiserver answers to `kubectl get`.

kubectl get sends `Accept: application/json;as=Table;v=v1;g=meta.k8s.io, ...` and prints
whatever columns the server returns, so the columns are the server's business. This module has
the Table itself and custom resources' columns: `Name`, then the CRD version's
`additionalPrinterColumns`, evaluated as the apiextensions server does (a simple JSONPath, the
first value; `type: string` printed as text, `integer`/`number`/`boolean` as JSON values,
`date` as a human age like "5s", "3m4s"); without printer columns, `Name` and `Age`. Built-in
kinds' columns are in `kubeemu_printers`.

Each row's `object` is a `PartialObjectMetadata` (the real default, `includeObject=Metadata`),
the whole object (`includeObject=Object`) or absent (`includeObject=None`).
"""

from __future__ import annotations

import datetime
import json
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
from kubeemu_request import StatusError

Obj = Mapping[str, Any]
_NAME_DOC = "Name must be unique within a namespace."
_AGE_DOC = (
    "CreationTimestamp is a timestamp representing the server time when this object was created."
)
_STEP = re.compile(
    r"\.([\w-]+)"  # .field
    r"|\[(\d+)\]"  # [index]
    r"|\[\*\]"  # [*]
    r"|\[\?\(@\.([\w.-]+)\s*==\s*[\"']([^\"']*)[\"']\)\]"  # [?(@.key=="value")]
)


def column(
    name: str, description: str = "", kind: str = "string", priority: int = 0, fmt: str = ""
) -> dict[str, Any]:
    """One `TableColumnDefinition`."""
    return {
        "name": name,
        "type": kind,
        "format": fmt,
        "description": description,
        "priority": priority,
    }


NAME = column("Name", _NAME_DOC, fmt="name")
AGE = column("Age", _AGE_DOC)


def human_duration(seconds: float) -> str:
    """A duration as Kubernetes prints ages: 5s, 119s, 2m3s, 10m, 3h4m, 2d3h, 30d, 2y10d."""
    if seconds < -1:
        return "<invalid>"
    secs = max(int(seconds), 0)
    minutes, hours, days = secs // 60, secs // 3600, secs // 86400
    if secs < 120:
        return f"{secs}s"
    if minutes < 10:
        return f"{minutes}m{secs % 60}s" if secs % 60 else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    if hours < 8:
        return f"{hours}h{minutes % 60}m" if minutes % 60 else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        return f"{days}d{hours % 24}h" if hours % 24 else f"{days}d"
    if hours < 24 * 365 * 2:
        return f"{days}d"
    if hours < 24 * 365 * 8:
        return f"{days // 365}y{days % 365}d" if days % 365 else f"{days // 365}y"
    return f"{days // 365}y"


def parse_time(value: Any) -> float | None:
    """An RFC 3339 timestamp as epoch seconds (None when absent or malformed)."""
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def age(timestamp: Any) -> str:
    """The age of a timestamp as printed in an AGE column ("<unknown>" without one)."""
    when = parse_time(timestamp)
    return "<unknown>" if when is None else human_duration(time.time() - when)


def json_path(obj: Any, path: str) -> list[Any]:
    """Every value at a simple JSONPath (`.a.b`, `.a[0]`, `.a[*].b`, `.a[?(@.k=="v")].b`)."""
    path = path.strip()
    if path.startswith("{") and path.endswith("}"):
        path = path[1:-1]
    values, pos = [obj], 0
    while pos < len(path):
        step = _STEP.match(path, pos)
        if step is None:
            raise ValueError(f"unsupported JSONPath {path!r} at {path[pos:]!r}")
        pos, (key, index, filter_key, filter_value) = step.end(), step.groups()
        found: list[Any] = []
        for value in values:
            if key is not None:
                if isinstance(value, Mapping) and key in value:
                    found.append(value[key])
            elif index is not None:
                if isinstance(value, list) and int(index) < len(value):
                    found.append(value[int(index)])
            elif filter_key is not None:
                found += [
                    item
                    for item in (value if isinstance(value, list) else [])
                    if _text(_dig(item, filter_key)) == filter_value
                ]
            elif isinstance(value, list):
                found += value
            elif isinstance(value, Mapping):
                found += list(value.values())
        values = found
    return values


def _dig(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = obj.get(part) if isinstance(obj, Mapping) else None
    return obj


def _text(value: Any) -> str | None:
    """A JSON value as JSONPath output prints it."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (Mapping, list)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def custom_cell(spec: Mapping[str, Any], obj: Obj) -> Any:
    """One cell of an additionalPrinterColumn, as the apiextensions server computes it."""
    values = json_path(obj, spec["jsonPath"])
    value = values[0] if values else None
    kind = spec.get("type", "string")
    if value is None:
        return None
    if kind == "string":
        return _text(value)
    if kind == "date":
        return age(value) if parse_time(value) is not None else "<invalid>"
    if kind == "integer" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    if kind == "number" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if kind == "boolean" and isinstance(value, bool):
        return value
    return None


@attrs.frozen
class Printer:
    """The columns of a resource and how to fill one row's cells."""

    columns: Sequence[Mapping[str, Any]]
    cells: Callable[[Obj], list[Any]]


def meta(obj: Obj) -> Obj:
    """An object's metadata ({} when absent)."""
    return obj.get("metadata") or {}


def name_age(obj: Obj) -> list[Any]:
    """The Name and Age cells of an object."""
    return [meta(obj).get("name"), age(meta(obj).get("creationTimestamp"))]


def custom_printer(specs: Sequence[Mapping[str, Any]]) -> Printer:
    """The printer of a CRD version with these additionalPrinterColumns (may be empty)."""
    if not specs:
        return Printer([NAME, AGE], name_age)
    columns = [NAME] + [
        column(
            s["name"],
            s.get("description")
            or f"Custom resource definition column (in JSONPath format): {s['jsonPath']}",
            s.get("type", "string"),
            int(s.get("priority", 0)),
            s.get("format", ""),
        )
        for s in specs
    ]
    return Printer(columns, lambda o: [meta(o).get("name")] + [custom_cell(s, o) for s in specs])


def _row_object(obj: Obj, include: str) -> dict[str, Any] | None:
    if include == "Object":
        return dict(obj)
    if include == "Metadata":
        return {
            "apiVersion": "meta.k8s.io/v1",
            "kind": "PartialObjectMetadata",
            "metadata": dict(meta(obj)),
        }
    return None


def to_table(
    printer: Printer,
    objs: Sequence[Obj],
    params: Mapping[str, str],
    resource_version: str,
) -> dict[str, Any]:
    """A `meta.k8s.io/v1` Table of objects; `params` may hold `includeObject`."""
    include = params.get("includeObject") or "Metadata"
    if include not in ("Metadata", "Object", "None"):
        raise StatusError(400, "BadRequest", f"includeObject: unsupported value {include!r}")
    rows = []
    for obj in objs:
        row: dict[str, Any] = {"cells": printer.cells(obj)}
        embedded = _row_object(obj, include)
        if embedded is not None:
            row["object"] = embedded
        rows.append(row)
    return {
        "apiVersion": "meta.k8s.io/v1",
        "kind": "Table",
        "metadata": {"resourceVersion": resource_version},
        "columnDefinitions": [dict(c) for c in printer.columns],
        "rows": rows,
    }
