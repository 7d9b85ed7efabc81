"""Pure builders: one Kubernetes manifest per child of an InferenceEngine.

Every function here returns a plain dict from explicit arguments and touches nothing else; the
reconcile (`reconcile.py`) decides which of them to create or patch, and the unit tests compare
them with golden manifests. Children of an engine named `NAME`:

    NAME-engine-<r>      Pod per data-parallel rank r     corefleet engine-core --rank r
    NAME-coordinator     Deployment (1 pod, CPU only)     corefleet coordinator
    NAME-coordinator     Service: HTTP API + ZMQ handshake port (the ranks' discovery)
    NAME-coordinator     NetworkPolicy: only this engine's ranks reach the ZMQ ports
    NAME-engine          headless Service for the rank pods (stable DNS, health port)
    NAME-engine          PodDisruptionBudget, maxUnavailable 1
    NAME-engine-args     ConfigMap: the engine-core flags every rank runs with
    NAME-curve           Secret: CURVE key pairs, generated once, never rewritten

Each child carries `corefleet.dev/spec-hash`, a hash of what the operator wants it to be, so the
reconcile can tell an outdated child from a current one without comparing server-filled fields.
"""

from __future__ import annotations

import base64
import json
import shlex
from typing import Any

from corefleet.operator.curve import CurveKeys
from corefleet.operator.flags import coordinator_args, engine_args, termination_grace_seconds
from corefleet.operator.naming import (
    COORDINATOR_HTTP_PORT,
    ENGINE_HEALTH_PORT,
    HANDSHAKE_PORT,
    HASH_ANNOTATION,
    INPUT_PORT,
    OUTPUT_PORT,
    RANK_LABEL,
    Owner,
    args_configmap_name,
    common_labels,
    coordinator_name,
    curve_secret_name,
    disruption_guard,
    engine_group_name,
    engine_pod_name,
    selector_labels,
    spec_hash,
)
from corefleet.operator.spec import API_VERSION, KIND, EngineSpec


def _meta(owner: Owner, name: str, component: str, content: Any) -> dict[str, Any]:
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


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _secret_env(name: str, secret: str, key: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def _cpu_request_env() -> dict[str, Any]:
    # The engine sizes its CPU threads from this (engine/worker/cpu_allowance.py): a pod without
    # exclusive cores still sees every core of the node in its affinity. No request: 0.
    return {
        "name": "COREFLEET_CPU_REQUEST_MILLICORES",
        "valueFrom": {"resourceFieldRef": {"resource": "requests.cpu", "divisor": "1m"}},
    }


def _pod_env() -> list[dict[str, Any]]:
    return [
        _field_env("POD_IP", "status.podIP"),
        _field_env("POD_NAME", "metadata.name"),
        _field_env("POD_NAMESPACE", "metadata.namespace"),
    ]


def _model_mounts(spec: EngineSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    if spec.model.volume is None:
        return [], []
    volume = {"name": "model", **dict(spec.model.volume)}
    return [volume], [{"name": "model", "mountPath": spec.model.mount_path, "readOnly": True}]


def _placement(spec: EngineSpec) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if spec.node_selector:
        out["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        out["tolerations"] = [dict(t) for t in spec.tolerations]
    if spec.affinity:
        out["affinity"] = dict(spec.affinity)
    return out


def _probe(path: str, port: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "timeoutSeconds": 2,
        "failureThreshold": failures,
    }


def engine_pod_template(name: str, spec: EngineSpec) -> dict[str, Any]:
    """The rank-independent part of every rank pod's spec; its hash is the pods' spec hash."""
    secret = curve_secret_name(name)
    volumes, mounts = _model_mounts(spec)
    container = {
        "name": "engine",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["corefleet"],
        "args": [
            "engine-core",
            "--coordinator",
            f"{coordinator_name(name)}:{HANDSHAKE_PORT}",
            *engine_args(spec),
        ],
        "env": [
            *_pod_env(),
            _cpu_request_env(),
            _secret_env("COREFLEET_CURVE_SERVER_KEY", secret, "server-public"),
            _secret_env("COREFLEET_CURVE_PUBLIC_KEY", secret, "client-public"),
            _secret_env("COREFLEET_CURVE_SECRET_KEY", secret, "client-secret"),
            *[dict(e) for e in spec.env],
        ],
        "ports": [{"name": "health", "containerPort": ENGINE_HEALTH_PORT, "protocol": "TCP"}],
        "readinessProbe": _probe("/ready", "health", 5, 3),
        "livenessProbe": _probe("/health", "health", 10, 6),
        "resources": dict(spec.resources or {}),
        "volumeMounts": [*mounts, {"name": "dshm", "mountPath": "/dev/shm"}],
    }
    return {
        "subdomain": engine_group_name(name),
        "restartPolicy": "Always",
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": termination_grace_seconds(spec),
        **_placement(spec),
        "containers": [container],
        "volumes": [*volumes, {"name": "dshm", "emptyDir": {"medium": "Memory"}}],
    }


def build_engine_pod(owner: Owner, spec: EngineSpec, rank: int) -> dict[str, Any]:
    """The pod of one rank. New pods start guarded from autoscaler disruption (they load)."""
    template = engine_pod_template(owner.name, spec)
    pod_name = engine_pod_name(owner.name, rank)
    meta = _meta(owner, pod_name, "engine", template)
    meta["labels"][RANK_LABEL] = str(rank)
    meta["annotations"].update(disruption_guard(True))
    pod_spec = json.loads(json.dumps(template))
    pod_spec["hostname"] = pod_name
    pod_spec["containers"][0]["args"][3:3] = ["--rank", str(rank)]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}


def build_coordinator_deployment(owner: Owner, spec: EngineSpec) -> dict[str, Any]:
    """The coordinator: one CPU-only pod, replaced with Recreate (two would split the ranks)."""
    name, secret = owner.name, curve_secret_name(owner.name)
    volumes, mounts = _model_mounts(spec)
    env = [
        *_pod_env(),
        _secret_env("COREFLEET_CURVE_PUBLIC_KEY", secret, "server-public"),
        _secret_env("COREFLEET_CURVE_SECRET_KEY", secret, "server-secret"),
        _secret_env("COREFLEET_CURVE_CLIENT_KEY", secret, "client-public"),
    ]
    ref = spec.coordinator.api_key_secret_ref
    if ref is not None:
        env.append(_secret_env("COREFLEET_API_KEY", ref.name, ref.key))
    ports = [
        ("http", COORDINATOR_HTTP_PORT),
        ("handshake", HANDSHAKE_PORT),
        ("input", INPUT_PORT),
        ("output", OUTPUT_PORT),
    ]
    container = {
        "name": "coordinator",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["corefleet"],
        "args": coordinator_args(name, spec),
        "env": env,
        "ports": [{"name": n, "containerPort": p, "protocol": "TCP"} for n, p in ports],
        "readinessProbe": _probe("/ready", "http", 5, 3),
        "livenessProbe": _probe("/health", "http", 10, 6),
        "resources": dict(spec.coordinator.resources or {}),
        "volumeMounts": mounts,
    }
    labels = common_labels(name, "coordinator")
    body = {
        "replicas": 1,
        "strategy": {"type": "Recreate"},
        "selector": {"matchLabels": selector_labels(name, "coordinator")},
        "template": {
            "metadata": {"labels": labels},
            "spec": {
                "enableServiceLinks": False,
                "terminationGracePeriodSeconds": termination_grace_seconds(spec),
                "containers": [container],
                "volumes": volumes,
            },
        },
    }
    meta = _meta(owner, coordinator_name(name), "coordinator", body)
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta, "spec": body}


def build_coordinator_service(owner: Owner, spec: EngineSpec) -> dict[str, Any]:
    """The API endpoint (type and port from the spec) plus the handshake port ranks dial."""
    http: dict[str, Any] = {
        "name": "http",
        "port": spec.coordinator.service_port,
        "targetPort": "http",
        "protocol": "TCP",
    }
    if spec.coordinator.node_port is not None:
        http["nodePort"] = spec.coordinator.node_port
    body = {
        "type": spec.coordinator.service_type,
        "selector": selector_labels(owner.name, "coordinator"),
        # The coordinator is ready only once a rank is, and ranks reach it through this
        # Service: without this, neither could ever become ready. HTTP clients of a coordinator
        # with no rank get a retryable 503 instead of a refused connection.
        "publishNotReadyAddresses": True,
        "ports": [
            http,
            {
                "name": "handshake",
                "port": HANDSHAKE_PORT,
                "targetPort": "handshake",
                "protocol": "TCP",
            },
        ],
    }
    meta = _meta(owner, coordinator_name(owner.name), "coordinator", body)
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": body}


def build_engine_service(owner: Owner) -> dict[str, Any]:
    """Headless Service: `<pod>.<name>-engine` DNS for each rank, also while it is not ready."""
    body = {
        "clusterIP": "None",
        "publishNotReadyAddresses": True,
        "selector": selector_labels(owner.name, "engine"),
        "ports": [
            {
                "name": "health",
                "port": ENGINE_HEALTH_PORT,
                "targetPort": "health",
                "protocol": "TCP",
            }
        ],
    }
    meta = _meta(owner, engine_group_name(owner.name), "engine", body)
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": body}


def build_args_configmap(owner: Owner, spec: EngineSpec) -> dict[str, Any]:
    """The engine flags, readable by people and tools (`kubectl get cm NAME-engine-args`)."""
    args = engine_args(spec)
    data = {
        "args.json": json.dumps(args),
        "args": shlex.join(args),
        "coordinator": f"{coordinator_name(owner.name)}:{HANDSHAKE_PORT}",
    }
    meta = _meta(owner, args_configmap_name(owner.name), "engine", data)
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data}


def build_pod_disruption_budget(owner: Owner) -> dict[str, Any]:
    """At most one rank voluntarily disrupted at a time (node drains, upgrades)."""
    body = {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(owner.name, "engine")}}
    meta = _meta(owner, engine_group_name(owner.name), "engine", body)
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": meta,
        "spec": body,
    }


def build_network_policy(owner: Owner) -> dict[str, Any]:
    """Only this engine's ranks reach the coordinator's ZMQ ports; its HTTP port stays open."""
    zmq_ports = [{"protocol": "TCP", "port": p} for p in (HANDSHAKE_PORT, INPUT_PORT, OUTPUT_PORT)]
    body = {
        "podSelector": {"matchLabels": selector_labels(owner.name, "coordinator")},
        "policyTypes": ["Ingress"],
        "ingress": [
            {
                "from": [{"podSelector": {"matchLabels": selector_labels(owner.name, "engine")}}],
                "ports": zmq_ports,
            },
            {"ports": [{"protocol": "TCP", "port": COORDINATOR_HTTP_PORT}]},
        ],
    }
    meta = _meta(owner, coordinator_name(owner.name), "coordinator", body)
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta,
        "spec": body,
    }


def build_curve_secret(owner: Owner, keys: CurveKeys) -> dict[str, Any]:
    """The CURVE keys; created once and never patched (its hash covers only its name)."""
    plain = {
        "server-public": keys.server.public,
        "server-secret": keys.server.secret,
        "client-public": keys.client.public,
        "client-secret": keys.client.secret,
    }
    data = {k: base64.b64encode(v.encode()).decode() for k, v in plain.items()}
    meta = _meta(owner, curve_secret_name(owner.name), "coordinator", curve_secret_name(owner.name))
    return {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "type": "Opaque", "data": data}


def build_children(
    owner: Owner, spec: EngineSpec, keys: CurveKeys | None = None
) -> list[dict[str, Any]]:
    """Every child except the rank pods; the Secret only when `keys` is given."""
    children = [
        build_args_configmap(owner, spec),
        build_coordinator_service(owner, spec),
        build_engine_service(owner),
        build_pod_disruption_budget(owner),
        build_network_policy(owner),
        build_coordinator_deployment(owner, spec),
    ]
    if keys is not None:
        children.insert(0, build_curve_secret(owner, keys))
    return children
