"""Shared test data for the reconcile and status tests: a spec, pods, observed children."""

from __future__ import annotations

import datetime
from typing import Any

from corefleet.operator.curve import CurveKeyPair, CurveKeys
from corefleet.operator.naming import DO_NOT_DISRUPT, HASH_ANNOTATION, Owner, spec_hash
from corefleet.operator.resources import build_children, engine_pod_template
from corefleet.operator.spec import EngineSpec, parse_spec

NOW = datetime.datetime(2026, 6, 1, 12, 0, 0, tzinfo=datetime.timezone.utc)
OWNER = Owner("llama", "default", "uid-1")
KEYS = CurveKeys(CurveKeyPair("a" * 40, "b" * 40), CurveKeyPair("c" * 40, "d" * 40))


def spec(ranks: int, **extra: Any) -> EngineSpec:
    """A minimal spec with `ranks` ranks and a 300 s progress deadline."""
    return parse_spec(
        {
            "image": "i",
            "model": {"path": "/m"},
            "dataParallelSize": ranks,
            "progressDeadlineSeconds": 300,
            **extra,
        }
    )


CURRENT = spec_hash(engine_pod_template("llama", spec(1)))
OLD = "0ld0ld0ld0ld"


def pod(
    rank: int,
    *,
    hash: str = CURRENT,
    ready: bool = True,
    phase: str = "Running",
    terminating: bool = False,
    age: float = 3600,
    guarded: bool | None = None,
):
    annotations = {HASH_ANNOTATION: hash}
    if guarded if guarded is not None else not ready:
        annotations[DO_NOT_DISRUPT] = "true"
    created = NOW - datetime.timedelta(seconds=age)
    meta = {
        "name": f"llama-engine-{rank}",
        "uid": f"pod-{rank}",
        "annotations": annotations,
        "labels": {"corefleet.dev/rank": str(rank)},
        "creationTimestamp": created.strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    if terminating:
        meta["deletionTimestamp"] = NOW.strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "metadata": meta,
        "status": {
            "phase": phase,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def children(**stale: str) -> dict[tuple[str, str], str | None]:
    found = {
        (c["kind"], c["metadata"]["name"]): c["metadata"]["annotations"][HASH_ANNOTATION]
        for c in build_children(OWNER, spec(1), KEYS)
    }
    found.update({tuple(k.split("/")): v for k, v in stale.items()})  # type: ignore[misc]
    return found
