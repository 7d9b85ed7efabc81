"""Names, labels, annotations and ports shared by the builders, the reconcile and the status.

A child's name is a pure function of the engine's name (`<name>-engine-<rank>`,
`<name>-coordinator`, ...), so the operator finds its children without storing anything, and
`spec_hash` lets it tell an outdated child from a current one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from corefleet.operator.spec import EngineSpec

HASH_ANNOTATION = "corefleet.dev/spec-hash"
ENGINE_LABEL = "corefleet.dev/engine"
RANK_LABEL = "corefleet.dev/rank"
COMPONENT_LABEL = "app.kubernetes.io/component"
SAFE_TO_EVICT = "cluster-autoscaler.kubernetes.io/safe-to-evict"
DO_NOT_DISRUPT = "karpenter.sh/do-not-disrupt"

ENGINE_HEALTH_PORT = 8001
COORDINATOR_HTTP_PORT = 8000
HANDSHAKE_PORT = 5570
INPUT_PORT = 5571
OUTPUT_PORT = 5572
# An expert-parallel group's rendezvous: rank 0 hosts the torch.distributed store here and every
# rank of the group dials it (vLLM's data-parallel RPC port, the engine's local default too).
DP_GROUP_PORT = 29550
GRACE_MARGIN_SECONDS = 15  # exit, flush logs and close sockets after the drain timeout
# A coordinator told to stop serves on, not ready, this long (within the margin above), while
# the Service's endpoints drop it: a rolling update of coordinators then fails no request.
COORDINATOR_SHUTDOWN_DELAY_SECONDS = 5
TEMPLATE_VERSION = "1"  # bump when a builder changes what running pods should look like


@dataclasses.dataclass(frozen=True)
class Owner:
    """The InferenceEngine that owns the children (from its metadata)."""

    name: str
    namespace: str
    uid: str


def engine_pod_name(name: str, rank: int) -> str:
    """`<name>-engine-<rank>`: rank pods have fixed names, one per rank."""
    return f"{name}-engine-{rank}"


def dp_group_address(name: str) -> str:
    """`<name>-engine-0.<name>-engine:29550`: rank 0's stable DNS name, the group's rendezvous.

    The headless Service `<name>-engine` (the pods' subdomain) publishes not-ready addresses, so
    the name resolves while rank 0 loads, before any rank is Ready; it names whichever pod holds
    rank 0 now, so a restarted group meets at its new rank 0.
    """
    return f"{engine_pod_name(name, 0)}.{engine_group_name(name)}:{DP_GROUP_PORT}"


def coordinator_name(name: str) -> str:
    """Name of the coordinator Deployment, HTTP Service, NetworkPolicy, PDB and HPA."""
    return f"{name}-coordinator"


def coordinator_discovery_name(name: str) -> str:
    """`<name>-coordinators`: the headless Service whose DNS name resolves to every coordinator.

    Ranks dial it (`--coordinator <name>-coordinators:5570`) and join each address it resolves
    to. The suffix is short on purpose: with a 50-character engine name (the CRD's limit) the
    Service name is 63 characters, the most a DNS label allows.
    """
    return f"{name}-coordinators"


def engine_group_name(name: str) -> str:
    """Name of the headless Service and the PodDisruptionBudget of the ranks."""
    return f"{name}-engine"


def args_configmap_name(name: str) -> str:
    """Name of the ConfigMap holding the engine flags."""
    return f"{name}-engine-args"


def curve_secret_name(name: str) -> str:
    """Name of the Secret with the CURVE keys."""
    return f"{name}-curve"


def common_labels(name: str, component: str) -> dict[str, str]:
    """Labels on every child: the engine it belongs to and its component."""
    return {
        "app.kubernetes.io/name": "corefleet",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/managed-by": "corefleet-operator",
        COMPONENT_LABEL: component,
        ENGINE_LABEL: name,
    }


def selector_labels(name: str, component: str) -> dict[str, str]:
    """The minimal labels that select one component's pods."""
    return {ENGINE_LABEL: name, COMPONENT_LABEL: component}


def rank_selector(name: str) -> str:
    """`status.selector` of the scale subresource: the rank pods, as a label-selector string."""
    return ",".join(f"{k}={v}" for k, v in selector_labels(name, "engine").items())


def endpoint(owner: Owner, spec: EngineSpec) -> str:
    """The in-cluster URL of the OpenAI API."""
    host = f"{coordinator_name(owner.name)}.{owner.namespace}.svc"
    return f"http://{host}:{spec.coordinator.service_port}"


def spec_hash(content: Any) -> str:
    """A short, stable hash of JSON-able content."""
    text = json.dumps([TEMPLATE_VERSION, content], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def disruption_guard(guarded: bool) -> dict[str, str | None]:
    """Annotations that keep cluster autoscalers off a loading or draining rank (None removes)."""
    return {
        SAFE_TO_EVICT: "false" if guarded else None,
        DO_NOT_DISRUPT: "true" if guarded else None,
    }
