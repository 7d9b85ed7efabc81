"""The local kubelet's Node object and heartbeat, as a real kubelet keeps them.

`node_document` is what the kubelet registers (POST /api/v1/nodes): the well-known labels, the
addresses where the API server reaches its log endpoint, capacity and allocatable (a
`NodeSize`: this machine's cores and memory unless the harness declares the node it stands in
for, 110 pods, and `nvidia.com/gpu` when the test gives the node GPUs),
the Ready condition and the node's info. The real scheduler places pods by these figures, and
the node lifecycle controller watches `heartbeat`'s Lease in `kube-node-lease`: a node that
stops renewing it is marked NotReady and its pods evicted, as on a cluster.
"""

from __future__ import annotations

import datetime
import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kubeapi import ApiError, KubeApi

NODE = "corefleet-local"
GPU = "nvidia.com/gpu"
LEASE_SECONDS = 40
KUBELET_VERSION = "v1.36.3"


@dataclass(frozen=True)
class NodeSize:
    """What the node tells the scheduler it has: cores, memory (a quantity), GPUs."""

    cpus: int
    memory: str
    gpus: int = 0


def this_machine(gpus: int = 0) -> NodeSize:
    """This machine's own cores and memory."""
    return NodeSize(os.cpu_count() or 1, f"{_memory_kib()}Ki", gpus)


def micro_now() -> str:
    """A MicroTime, as a Lease's renewTime is written."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def node_labels() -> dict[str, str]:
    """The well-known labels a kubelet sets on its node."""
    arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
    return {
        "kubernetes.io/arch": arch,
        "kubernetes.io/os": "linux",
        "kubernetes.io/hostname": NODE,
        "beta.kubernetes.io/arch": arch,
        "beta.kubernetes.io/os": "linux",
    }


def _memory_kib() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemTotal:"):
                return int(line.split()[1])
    return 0


def node_conditions(now: str) -> list[dict[str, str]]:
    """The conditions of a healthy node."""
    quiet = [
        ("MemoryPressure", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
        ("DiskPressure", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
        ("PIDPressure", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
    ]
    conditions = [
        {
            "type": kind,
            "status": "False",
            "reason": reason,
            "message": message,
            "lastHeartbeatTime": now,
            "lastTransitionTime": now,
        }
        for kind, reason, message in quiet
    ]
    conditions.append(
        {
            "type": "Ready",
            "status": "True",
            "reason": "KubeletReady",
            "message": "kubelet is posting ready status",
            "lastHeartbeatTime": now,
            "lastTransitionTime": now,
        }
    )
    return conditions


def node_status(address: str, port: int, size: NodeSize, now: str) -> dict[str, Any]:
    """The node's `status`: capacity, conditions, addresses and the log endpoint."""
    capacity = {
        "cpu": str(size.cpus),
        "memory": size.memory,
        "pods": "110",
        "ephemeral-storage": "100Gi",
    }
    if size.gpus:
        capacity[GPU] = str(size.gpus)
    return {
        "capacity": capacity,
        "allocatable": dict(capacity),
        "conditions": node_conditions(now),
        "addresses": [
            {"type": "InternalIP", "address": address},
            {"type": "Hostname", "address": NODE},
        ],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": port}},
        "nodeInfo": {
            "architecture": node_labels()["kubernetes.io/arch"],
            "operatingSystem": "linux",
            "osImage": "corefleet local node",
            "kernelVersion": platform.release(),
            "kubeletVersion": KUBELET_VERSION,
            "kubeProxyVersion": "",
            "containerRuntimeVersion": "corefleet-netns://1",
            "machineID": "",
            "systemUUID": "",
            "bootID": "",
        },
    }


def node_document(address: str, port: int, size: NodeSize) -> dict[str, Any]:
    """The Node the kubelet registers."""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": NODE, "labels": node_labels()},
        "spec": {},
        "status": node_status(address, port, size, micro_now()[:19] + "Z"),
    }


async def register(api: KubeApi, address: str, port: int, size: NodeSize) -> None:
    """Create the Node, or take over the one a previous kubelet of this name left."""
    document = node_document(address, port, size)
    try:
        await api.call("POST", "/api/v1/nodes", document)
    except ApiError as err:
        if err.status != 409:
            raise
        existing = await api.call("GET", f"/api/v1/nodes/{NODE}")
        merged = {**existing, "metadata": {**existing["metadata"], "labels": node_labels()}}
        await api.call("PUT", f"/api/v1/nodes/{NODE}", merged)
    # The status is a subresource: the create above drops it.
    await api.call(
        "PATCH",
        f"/api/v1/nodes/{NODE}/status",
        {"status": document["status"]},
        {"Content-Type": "application/merge-patch+json"},
    )


async def heartbeat(api: KubeApi) -> None:
    """Renew the node's Lease (create it the first time), as the kubelet does every 10 s."""
    path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{NODE}"
    lease: Mapping[str, Any] | None = await api.call("GET", path, ok_missing=True)
    spec = {"holderIdentity": NODE, "leaseDurationSeconds": LEASE_SECONDS, "renewTime": micro_now()}
    if lease is None:
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": NODE, "namespace": "kube-node-lease"},
            "spec": spec,
        }
        await api.call("POST", path.rsplit("/", 1)[0], body)
        return
    await api.call("PUT", path, {**lease, "spec": {**lease["spec"], **spec}})
