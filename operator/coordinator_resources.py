"""Pure builders of the coordinator's children: its Deployment, two Services, NetworkPolicy, PDB
and, with `spec.coordinator.autoscaling`, its HorizontalPodAutoscaler.

Every rank joins every coordinator: a rank resolves the headless Service `NAME-coordinators` to
all coordinator pod addresses and runs a handshake with each (it re-resolves every few seconds,
so coordinators that appear or restart are joined too). Coordinators never talk to each other,
so any number of them can run side by side, and the HTTP Service `NAME-coordinator` spreads
clients over the Ready ones. Children of an engine named `NAME`:

    NAME-coordinator     Deployment (spec.coordinator.replicas, or the HPA's count), rolling
    NAME-coordinator     Service: the HTTP API, Ready coordinators only
    NAME-coordinators    headless Service: every coordinator pod's address, for the ranks
    NAME-coordinator     NetworkPolicy: only this engine's ranks reach the ZMQ ports
    NAME-coordinator     PodDisruptionBudget, maxUnavailable 1
    NAME-coordinator     HorizontalPodAutoscaler on CPU (only with spec.coordinator.autoscaling)
"""

from __future__ import annotations

from typing import Any

from corefleet.operator.flags import coordinator_args, termination_grace_seconds
from corefleet.operator.manifest import child_meta, model_mounts, pod_env, probe, secret_env
from corefleet.operator.naming import (
    COORDINATOR_HTTP_PORT,
    HANDSHAKE_PORT,
    INPUT_PORT,
    OUTPUT_PORT,
    Owner,
    common_labels,
    coordinator_discovery_name,
    coordinator_name,
    curve_secret_name,
    selector_labels,
)
from corefleet.operator.spec import EngineSpec


def coordinator_address(name: str) -> str:
    """What ranks get as `--coordinator`: the headless Service's name and the handshake port."""
    return f"{coordinator_discovery_name(name)}:{HANDSHAKE_PORT}"


def build_coordinator_deployment(owner: Owner, spec: EngineSpec) -> dict[str, Any]:
    """The coordinators: CPU-only pods, replaced one at a time with a surge (never fewer).

    With `spec.coordinator.autoscaling` the Deployment carries no `replicas`: the HPA sets it
    (through the scale subresource), and a merge patch without the field leaves the HPA's
    value alone when the operator updates the Deployment for another reason.
    """
    name, secret = owner.name, curve_secret_name(owner.name)
    volumes, mounts = model_mounts(spec)
    env = [
        *pod_env(),
        secret_env("COREFLEET_CURVE_PUBLIC_KEY", secret, "server-public"),
        secret_env("COREFLEET_CURVE_SECRET_KEY", secret, "server-secret"),
        secret_env("COREFLEET_CURVE_CLIENT_KEY", secret, "client-public"),
    ]
    ref = spec.coordinator.api_key_secret_ref
    if ref is not None:
        env.append(secret_env("COREFLEET_API_KEY", ref.name, ref.key))
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
        "readinessProbe": probe("/ready", "http", 5, 3),
        "livenessProbe": probe("/health", "http", 10, 6),
        "resources": dict(spec.coordinator.resources or {}),
        "volumeMounts": mounts,
    }
    body: dict[str, Any] = {}
    if spec.coordinator.autoscaling is None:
        body["replicas"] = spec.coordinator.replicas
    body.update(
        {
            # Two coordinators side by side split nothing (every rank joins each), so a rollout
            # starts the new pod first and stops an old one only once the new one is Ready: the
            # API never loses a Ready coordinator to an update.
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
            },
            "selector": {"matchLabels": selector_labels(name, "coordinator")},
            "template": {
                "metadata": {"labels": common_labels(name, "coordinator")},
                "spec": {
                    "enableServiceLinks": False,
                    # Coordinators never call the Kubernetes API: no token in the pod.
                    "automountServiceAccountToken": False,
                    "terminationGracePeriodSeconds": termination_grace_seconds(spec),
                    "containers": [container],
                    "volumes": volumes,
                },
            },
        }
    )
    meta = child_meta(owner, coordinator_name(name), "coordinator", body)
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta, "spec": body}


def build_coordinator_service(owner: Owner, spec: EngineSpec) -> dict[str, Any]:
    """The API endpoint (type and port from the spec), routing to Ready coordinators only.

    A coordinator is Ready once a rank has joined it and stops being Ready the moment it gets
    SIGTERM, so clients reach only coordinators that can serve them, and a stopping one gets no
    new connections while it finishes its streams. Ranks do not use this Service.
    """
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
        # Explicitly false, not left out: a merge patch keeps a field it omits, and earlier
        # operators set it true on this Service (ranks dialled it before NAME-coordinators).
        "publishNotReadyAddresses": False,
        "ports": [http],
    }
    meta = child_meta(owner, coordinator_name(owner.name), "coordinator", body)
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": body}


def build_coordinator_discovery_service(owner: Owner) -> dict[str, Any]:
    """Headless Service whose name resolves to every coordinator pod, Ready or not.

    Ranks dial it: a coordinator is Ready only once a rank has joined it, so ranks must find
    coordinators that are not Ready yet (publishNotReadyAddresses), and a headless Service's DNS
    name answers with every pod address instead of one virtual IP.
    """
    body = {
        "clusterIP": "None",
        "publishNotReadyAddresses": True,
        "selector": selector_labels(owner.name, "coordinator"),
        "ports": [
            {
                "name": "handshake",
                "port": HANDSHAKE_PORT,
                "targetPort": "handshake",
                "protocol": "TCP",
            }
        ],
    }
    meta = child_meta(owner, coordinator_discovery_name(owner.name), "coordinator", body)
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": body}


def build_network_policy(owner: Owner) -> dict[str, Any]:
    """Only this engine's ranks reach any coordinator's ZMQ ports; the HTTP port stays open."""
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
    meta = child_meta(owner, coordinator_name(owner.name), "coordinator", body)
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta,
        "spec": body,
    }


def build_coordinator_disruption_budget(owner: Owner) -> dict[str, Any]:
    """At most one coordinator voluntarily disrupted at a time.

    maxUnavailable rather than minAvailable: with one coordinator, minAvailable 1 would block
    every node drain for good, while maxUnavailable 1 lets it go (the API is down until it is
    rescheduled, as it would be without a budget); with two or more, a drain always leaves one.
    """
    body = {
        "maxUnavailable": 1,
        "selector": {"matchLabels": selector_labels(owner.name, "coordinator")},
    }
    meta = child_meta(owner, coordinator_name(owner.name), "coordinator", body)
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": meta,
        "spec": body,
    }


def build_coordinator_autoscaler(owner: Owner, spec: EngineSpec) -> dict[str, Any] | None:
    """The HPA on the coordinator Deployment's CPU utilization; None without autoscaling.

    The coordinator's event loop is one thread, so its CPU use is the measure of its load.
    Utilization is relative to the container's CPU request, which the HPA therefore needs.
    """
    scaling = spec.coordinator.autoscaling
    if scaling is None:
        return None
    body = {
        "scaleTargetRef": {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": coordinator_name(owner.name),
        },
        "minReplicas": scaling.min_replicas,
        "maxReplicas": scaling.max_replicas,
        "metrics": [
            {
                "type": "Resource",
                "resource": {
                    "name": "cpu",
                    "target": {
                        "type": "Utilization",
                        "averageUtilization": scaling.target_cpu_utilization_percentage,
                    },
                },
            }
        ],
    }
    meta = child_meta(owner, coordinator_name(owner.name), "coordinator", body)
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": meta,
        "spec": body,
    }


def build_coordinator_children(owner: Owner, spec: EngineSpec) -> list[dict[str, Any]]:
    """The coordinator's children: Services and policies, the Deployment, then its HPA."""
    children = [
        build_coordinator_service(owner, spec),
        build_coordinator_discovery_service(owner),
        build_coordinator_disruption_budget(owner),
        build_network_policy(owner),
        build_coordinator_deployment(owner, spec),
    ]
    autoscaler = build_coordinator_autoscaler(owner, spec)
    if autoscaler is not None:
        children.append(autoscaler)
    return children
