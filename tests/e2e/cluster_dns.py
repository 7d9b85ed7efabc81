"""Cluster DNS as /etc/hosts files: what CoreDNS answers, from the real EndpointSlices.

`hosts_entries` reads the Services and the EndpointSlices that kube-controller-manager's
EndpointSlice controller writes for them, as CoreDNS's kubernetes plugin does: every Service
name form (`svc`, `svc.ns`, `svc.ns.svc`, `svc.ns.svc.cluster.local`) maps to the addresses of
its Ready endpoints (the controller marks every endpoint ready under
`publishNotReadyAddresses`, and never a terminating pod), and a headless Service's endpoints
with a hostname (a pod whose `hostname` and `subdomain` match the Service) also get
`<hostname>.<svc>` in each of those forms (an expert-parallel group meets at
`<name>-engine-0.<name>-engine`, which cluster DNS resolves through the pod's search path; these
files have no search path, so every form is listed). There is no virtual IP and no port
translation: a name resolves to pod addresses and clients use the container port (the
operator's Services use the same numbers for both).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

Obj = Mapping[str, Any]
SERVICE_NAME_LABEL = "kubernetes.io/service-name"


def _names(service: str, namespace: str) -> list[str]:
    return [
        service,
        f"{service}.{namespace}",
        f"{service}.{namespace}.svc",
        f"{service}.{namespace}.svc.cluster.local",
    ]


def _ready_endpoints(slices: Sequence[Obj], namespace: str, service: str) -> list[Obj]:
    found = []
    for piece in slices:
        meta = piece.get("metadata") or {}
        labels = meta.get("labels") or {}
        if meta.get("namespace") != namespace or labels.get(SERVICE_NAME_LABEL) != service:
            continue
        for endpoint in piece.get("endpoints") or ():
            # An absent `ready` means ready (the EndpointSlice API's rule).
            if (endpoint.get("conditions") or {}).get("ready", True):
                found.append(endpoint)
    return found


def hosts_entries(services: Sequence[Obj], slices: Sequence[Obj]) -> list[tuple[str, str, str]]:
    """(namespace, address, name) for every DNS name a pod may look up.

    The namespace says where the short forms (`svc`, `svc.ns`) apply: a pod resolves them only
    for Services of its own namespace.
    """
    entries: list[tuple[str, str, str]] = []
    for svc in services:
        ns, name = svc["metadata"]["namespace"], svc["metadata"]["name"]
        headless = (svc.get("spec") or {}).get("clusterIP") == "None"
        for endpoint in _ready_endpoints(slices, ns, name):
            for ip in endpoint.get("addresses") or ():
                entries += [(ns, ip, n) for n in _names(name, ns)]
                hostname = endpoint.get("hostname")
                if headless and hostname:
                    entries += [(ns, ip, f"{hostname}.{n}") for n in _names(name, ns)]
    return entries


def hosts_file(
    entries: Sequence[tuple[str, str, str]],
    namespace: str | None,
    own: tuple[str, str] | None = None,
) -> str:
    """An /etc/hosts for a pod of `namespace` (None: the node, fully qualified names only)."""
    lines = ["127.0.0.1 localhost"]
    if own is not None:
        lines.append(f"{own[0]} {own[1]}")
    for ns, ip, name in entries:
        short = name.count(".") < 2
        if short and ns != namespace:
            continue
        lines.append(f"{ip} {name}")
    return "\n".join(lines) + "\n"
