"""Pure builders: one Kubernetes manifest per child of an InferenceEngine.

Every function here returns a plain dict from explicit arguments and touches nothing else; the
reconcile (`reconcile.py`) decides which of them to create or patch, and the unit tests compare
them with golden manifests. Children of an engine named `NAME`:

    NAME-engine-<r>      Pod per data-parallel rank r     corefleet engine-core --rank r
    NAME-engine          headless Service for the rank pods (stable DNS, health port)
    NAME-engine          PodDisruptionBudget, maxUnavailable 1 (100% for an expert-parallel group)
    NAME-engine-args     ConfigMap: the engine-core flags every rank runs with
    NAME-curve           Secret: CURVE key pairs, generated once, never rewritten
    NAME-coordinator...  the coordinators' Deployment, Services, NetworkPolicy, PDB and HPA
                         (`coordinator_resources.py`)

Each child carries `corefleet.dev/spec-hash`, a hash of what the operator wants it to be, so the
reconcile can tell an outdated child from a current one without comparing server-filled fields.
"""

from __future__ import annotations

import base64
import json
import shlex
from typing import Any

from corefleet.operator.coordinator_resources import (
    build_coordinator_children,
    coordinator_address,
)
from corefleet.operator.curve import CurveKeys
from corefleet.operator.flags import rank_args, termination_grace_seconds
from corefleet.operator.manifest import (
    child_meta,
    model_mounts,
    placement,
    pod_env,
    probe,
    secret_env,
)
from corefleet.operator.naming import (
    DP_GROUP_PORT,
    ENGINE_HEALTH_PORT,
    RANK_LABEL,
    Owner,
    args_configmap_name,
    curve_secret_name,
    disruption_guard,
    engine_group_name,
    engine_pod_name,
    selector_labels,
)
from corefleet.operator.spec import EngineSpec


def _cpu_request_env() -> dict[str, Any]:
    # The engine sizes its CPU threads from this (engine/worker/cpu_allowance.py): a pod without
    # exclusive cores still sees every core of the node in its affinity. No request: 0.
    return {
        "name": "COREFLEET_CPU_REQUEST_MILLICORES",
        "valueFrom": {"resourceFieldRef": {"resource": "requests.cpu", "divisor": "1m"}},
    }


def _group_ports(spec: EngineSpec | None, key: str) -> list[dict[str, Any]]:
    """The expert-parallel group's rendezvous port (rank 0 serves it), as a container port
    (`key` containerPort) or a Service port (`key` port); none for an ordinary fleet, whose
    pods and Service then stay as they were (no roll, no patch)."""
    if spec is None or not spec.enable_expert_parallel:
        return []
    port: dict[str, Any] = {"name": "dp-group", key: DP_GROUP_PORT, "protocol": "TCP"}
    if key == "port":
        port["targetPort"] = "dp-group"
    return [port]


def engine_pod_template(name: str, spec: EngineSpec) -> dict[str, Any]:
    """The rank-independent part of every rank pod's spec; its hash is the pods' spec hash."""
    secret = curve_secret_name(name)
    volumes, mounts = model_mounts(spec)
    container = {
        "name": "engine",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["corefleet"],
        "args": [
            "engine-core",
            "--coordinator",
            coordinator_address(name),
            *rank_args(name, spec),
        ],
        "env": [
            *pod_env(),
            _cpu_request_env(),
            secret_env("COREFLEET_CURVE_SERVER_KEY", secret, "server-public"),
            secret_env("COREFLEET_CURVE_PUBLIC_KEY", secret, "client-public"),
            secret_env("COREFLEET_CURVE_SECRET_KEY", secret, "client-secret"),
            *[dict(e) for e in spec.env],
        ],
        "ports": [
            {"name": "health", "containerPort": ENGINE_HEALTH_PORT, "protocol": "TCP"},
            *_group_ports(spec, "containerPort"),
        ],
        "readinessProbe": probe("/ready", "health", 5, 3),
        "livenessProbe": probe("/health", "health", 10, 6),
        "resources": dict(spec.resources or {}),
        "volumeMounts": [*mounts, {"name": "dshm", "mountPath": "/dev/shm"}],
    }
    return {
        "subdomain": engine_group_name(name),
        "restartPolicy": "Always",
        "enableServiceLinks": False,
        # Ranks never call the Kubernetes API: no token in the pod (least privilege).
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": termination_grace_seconds(spec),
        **placement(spec),
        "containers": [container],
        "volumes": [*volumes, {"name": "dshm", "emptyDir": {"medium": "Memory"}}],
    }


def build_engine_pod(owner: Owner, spec: EngineSpec, rank: int) -> dict[str, Any]:
    """The pod of one rank. New pods start guarded from autoscaler disruption (they load)."""
    template = engine_pod_template(owner.name, spec)
    pod_name = engine_pod_name(owner.name, rank)
    meta = child_meta(owner, pod_name, "engine", template)
    meta["labels"][RANK_LABEL] = str(rank)
    meta["annotations"].update(disruption_guard(True))
    pod_spec = json.loads(json.dumps(template))
    pod_spec["hostname"] = pod_name
    pod_spec["containers"][0]["args"][3:3] = ["--rank", str(rank)]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}


def build_engine_service(owner: Owner, spec: EngineSpec | None = None) -> dict[str, Any]:
    """Headless Service: `<pod>.<name>-engine` DNS for each rank, also while it is not ready.

    With an expert-parallel `spec` it also lists the group's rendezvous port: the group meets at
    `<name>-engine-0.<name>-engine`, which must resolve while rank 0 still loads (hence
    `publishNotReadyAddresses`, which every engine has anyway).
    """
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
            },
            *_group_ports(spec, "port"),
        ],
    }
    meta = child_meta(owner, engine_group_name(owner.name), "engine", body)
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": body}


def build_args_configmap(owner: Owner, spec: EngineSpec) -> dict[str, Any]:
    """The engine flags, readable by people and tools (`kubectl get cm NAME-engine-args`)."""
    args = rank_args(owner.name, spec)
    data = {
        "args.json": json.dumps(args),
        "args": shlex.join(args),
        "coordinator": coordinator_address(owner.name),
    }
    meta = child_meta(owner, args_configmap_name(owner.name), "engine", data)
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data}


def build_pod_disruption_budget(owner: Owner, spec: EngineSpec | None = None) -> dict[str, Any]:
    """At most one rank voluntarily disrupted at a time (node drains, upgrades).

    Not so for an expert-parallel `spec`: evicting any one rank of the group stops the whole
    group (the others' collectives need it; they drain and restart with it), so a budget of one
    would only serialize a node drain into one whole-group restart per rank on the node, each a
    full reload, with evictions held while the group reloads. `100%` lets a drain evict all the
    group's ranks on the node at once: one restart per drain. Autoscalers, which evict for cost
    rather than need, are kept off the group's ranks by their annotations instead (reconcile
    rule 5). The budget stays an object, so turning expert parallelism on or off patches it.
    """
    expert_parallel = spec is not None and spec.enable_expert_parallel
    body = {
        "maxUnavailable": "100%" if expert_parallel else 1,
        "selector": {"matchLabels": selector_labels(owner.name, "engine")},
    }
    meta = child_meta(owner, engine_group_name(owner.name), "engine", body)
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
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
    meta = child_meta(
        owner, curve_secret_name(owner.name), "coordinator", curve_secret_name(owner.name)
    )
    return {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "type": "Opaque", "data": data}


def build_children(
    owner: Owner, spec: EngineSpec, keys: CurveKeys | None = None
) -> list[dict[str, Any]]:
    """Every child except the rank pods; the Secret only when `keys` is given."""
    children = [
        build_args_configmap(owner, spec),
        build_engine_service(owner, spec),
        build_pod_disruption_budget(owner, spec),
        *build_coordinator_children(owner, spec),
    ]
    if keys is not None:
        children.insert(0, build_curve_secret(owner, keys))
    return children
