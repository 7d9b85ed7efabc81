"""The CRD documents itself: `kubectl explain ie.spec` has a description for every field.

kube-apiserver publishes the CRD's `openAPIV3Schema` as the kind's OpenAPI schema, and
`kubectl explain` prints each property's `description`. So every property, at any depth (in
`properties`, array `items` and `additionalProperties`), needs one, and a property with a
`default` names it, so that nobody has to read the YAML to learn it. Printer columns are
described too (`kubectl get ie -o wide` shows them; their descriptions are in the Table).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

from crdcheck import SCHEMA, VERSION


def properties(schema: Mapping[str, Any], path: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted path, schema) of every property below `schema`, depth first."""
    for name, sub in (schema.get("properties") or {}).items():
        yield f"{path}.{name}", sub
        yield from properties(sub, f"{path}.{name}")
    items = schema.get("items")
    if isinstance(items, Mapping):
        yield from properties(items, f"{path}[]")
    extra = schema.get("additionalProperties")
    if isinstance(extra, Mapping):
        yield from properties(extra, f"{path}{{}}")


def shown(value: Any) -> str:
    """A default as a description writes it: true, 0.9, /models."""
    return json.dumps(value) if isinstance(value, bool) else str(value)


def test_the_walk_sees_every_level() -> None:
    paths = dict(properties(SCHEMA))
    assert ".spec.engine.maxNumSeqs" in paths
    assert ".spec.env[].valueFrom" in paths
    assert ".spec.model.volume.persistentVolumeClaim.claimName" in paths
    assert ".status.conditions[].lastTransitionTime" in paths
    assert len(paths) > 80


# kube-apiserver refuses anything on the root `metadata` but `type: object` (and restrictions on
# name and generateName): "must not specify anything other than name and generateName, but
# metadata is implicitly specified". `kubectl explain` takes its description from ObjectMeta.
ROOT_METADATA = ".metadata"


def test_the_root_metadata_is_only_an_object() -> None:
    root_metadata = SCHEMA["properties"]["metadata"]
    assert set(root_metadata) <= {"type", "properties"}, root_metadata
    assert root_metadata["type"] == "object"
    assert set(root_metadata.get("properties", {})) <= {"name", "generateName"}


def test_every_property_has_a_description() -> None:
    missing = [
        path
        for path, sub in properties(SCHEMA)
        if path != ROOT_METADATA and not str(sub.get("description", ""))
    ]
    assert missing == [], f"properties without a description: {missing}"
    assert SCHEMA.get("description")


def test_every_description_is_a_sentence() -> None:
    bad = [
        path
        for path, sub in properties(SCHEMA)
        if path != ROOT_METADATA
        and (
            not sub["description"].strip().endswith((".", ")"))
            or not sub["description"][0].isupper()
        )
    ]
    assert bad == [], f"descriptions should start upper-case and end with a full stop: {bad}"


def test_every_scalar_default_is_named_in_the_description() -> None:
    unnamed = [
        path
        for path, sub in properties(SCHEMA)
        if "default" in sub
        and not isinstance(sub["default"], Mapping)
        and f"Default {shown(sub['default'])}" not in sub["description"]
    ]
    assert unnamed == [], f"say 'Default <value>' in the description of: {unnamed}"


def test_every_printer_column_is_described() -> None:
    undescribed = [
        c["name"]
        for c in VERSION["additionalPrinterColumns"]
        if not c.get("description") and c["type"] != "date"
    ]
    assert undescribed == []
