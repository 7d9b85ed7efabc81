"""Pieces shared by the builders of the rank children (`resources.py`) and the coordinator's
(`coordinator_resources.py`): child metadata with its spec hash and owner reference, env entries,
the model volume, placement and probes. Pure functions of their arguments.
"""

from __future__ import annotations

from typing import Any

from corefleet.operator.naming import HASH_ANNOTATION, Owner, common_labels, spec_hash
from corefleet.operator.spec import API_VERSION, KIND, EngineSpec


def child_meta(owner: Owner, name: str, component: str, content: Any) -> dict[str, Any]:
    """Metadata of a child: labels, the spec hash of `content`, the controller owner reference."""
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": common_labels(owner.name, component),
        "annotations": {HASH_ANNOTATION: spec_hash(content)},
        "ownerReferences": [
            {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "name": owner.name,
                "uid": owner.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ],
    }


def field_env(name: str, path: str) -> dict[str, Any]:
    """An env entry from the downward API (`metadata.name`, `status.podIP`, ...)."""
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def secret_env(name: str, secret: str, key: str) -> dict[str, Any]:
    """An env entry read from a key of a Secret."""
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def pod_env() -> list[dict[str, Any]]:
    """POD_IP, POD_NAME and POD_NAMESPACE: the engine and the coordinator read all three."""
    return [
        field_env("POD_IP", "status.podIP"),
        field_env("POD_NAME", "metadata.name"),
        field_env("POD_NAMESPACE", "metadata.namespace"),
    ]


def model_mounts(spec: EngineSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The model's volume and its read-only mount; both empty when the image holds the model."""
    if spec.model.volume is None:
        return [], []
    volume = {"name": "model", **dict(spec.model.volume)}
    return [volume], [{"name": "model", "mountPath": spec.model.mount_path, "readOnly": True}]


def placement(spec: EngineSpec) -> dict[str, Any]:
    """The rank pods' nodeSelector, tolerations and affinity, only those that are set."""
    out: dict[str, Any] = {}
    if spec.node_selector:
        out["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        out["tolerations"] = [dict(t) for t in spec.tolerations]
    if spec.affinity:
        out["affinity"] = dict(spec.affinity)
    return out


def probe(path: str, port: str, period: int, failures: int) -> dict[str, Any]:
    """An HTTP GET probe on a named container port."""
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "timeoutSeconds": 2,
        "failureThreshold": failures,
    }
