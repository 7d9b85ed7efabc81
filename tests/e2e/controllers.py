"""The control-plane parts a cluster would add: a Deployment controller and Service DNS.

`DeploymentController.sync` keeps each Deployment's pods present: it creates pods from the
template (named `<deployment>-<template hash>-<5 chars>`, labelled `pod-template-hash`, owned by
the Deployment so deleting it deletes them), replaces pods of an old template (Recreate: all old
pods gone before a new one starts; RollingUpdate: new ones within `maxSurge` above the count,
old ones while `maxUnavailable` allows, as Ready pods come), and writes the Deployment's status.
No ReplicaSets: the pods belong to the Deployment directly.

`hosts_entries` is cluster DNS as `/etc/hosts` lines: every Service name form
(`svc`, `svc.ns`, `svc.ns.svc`, `svc.ns.svc.cluster.local`) maps to the addresses of the pods
behind it (ready ones, or all running ones with `publishNotReadyAddresses`; never a terminating
pod), and a headless Service's pods also get `<hostname>.<svc>` in each of those forms (an
expert-parallel group meets at `<name>-engine-0.<name>-engine`, which cluster DNS resolves
through the pod's search path; these files have no search path, so every form is listed). There is
no virtual IP and no port translation: a name resolves to pod addresses and clients use the
container port (the operator's Services use the same numbers for both).
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from kubeapi import KubeApi

logger = logging.getLogger("kubelet")
Obj = Mapping[str, Any]


def _ready(pod: Obj) -> bool:
    for cond in (pod.get("status") or {}).get("conditions") or ():
        if cond.get("type") == "Ready":
            return bool(cond.get("status") == "True")
    return False


def _terminating(pod: Obj) -> bool:
    return bool(pod["metadata"].get("deletionTimestamp"))


def _selected(pod: Obj, selector: Mapping[str, str], namespace: str) -> bool:
    labels = pod["metadata"].get("labels") or {}
    return pod["metadata"].get("namespace") == namespace and all(
        labels.get(k) == v for k, v in selector.items()
    )


def _owned_by(pod: Obj, uid: str) -> bool:
    return any(ref.get("uid") == uid for ref in pod["metadata"].get("ownerReferences") or ())


def _bound(value: Any, want: int, round_up: bool) -> int:
    if isinstance(value, str) and value.endswith("%"):
        share = want * int(value[:-1])
        return -(-share // 100) if round_up else share // 100
    return int(value)


def rolling_bounds(spec: Obj, want: int) -> tuple[int, int]:
    """(maxSurge, maxUnavailable) of a RollingUpdate Deployment, in pods.

    As the Deployment controller reads them: absent means 25 %, a surge percentage rounds up
    and an unavailability percentage down, and both 0 (the API refuses it) counts as 1
    unavailable.
    """
    rolling = (spec.get("strategy") or {}).get("rollingUpdate") or {}
    surge = _bound(rolling.get("maxSurge", "25%"), want, round_up=True)
    unavailable = _bound(rolling.get("maxUnavailable", "25%"), want, round_up=False)
    return surge, unavailable if surge or unavailable else 1


def template_hash(template: Obj) -> str:
    """A short stable hash of a pod template (the `pod-template-hash` label)."""
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


class DeploymentController:
    """Keeps Deployments' pods present and their status current."""

    def __init__(self, api: KubeApi) -> None:
        self.api = api

    async def sync(self, deployments: Sequence[Obj], pods: Sequence[Obj]) -> None:
        """One pass over every Deployment."""
        for deployment in deployments:
            if not _terminating(deployment):
                await self._sync_one(deployment, pods)

    async def _sync_one(self, dep: Obj, pods: Sequence[Obj]) -> None:
        meta, spec = dep["metadata"], dep.get("spec") or {}
        ns, uid = meta["namespace"], meta["uid"]
        want = int(spec.get("replicas", 1))
        current_hash = template_hash(spec.get("template") or {})
        owned = [p for p in pods if _owned_by(p, uid)]
        live = [p for p in owned if not _terminating(p)]
        new = [p for p in live if p["metadata"]["labels"].get("pod-template-hash") == current_hash]
        old = [p for p in live if p not in new]
        recreate = (spec.get("strategy") or {}).get("type") == "Recreate"
        if recreate and old:
            for pod in old:
                await self.api.delete("v1", "pods", ns, pod["metadata"]["name"])
        elif recreate and any(_terminating(p) for p in owned):
            pass  # Recreate: nothing new starts until every old pod is gone
        else:
            surge, unavailable = rolling_bounds(spec, want)
            # New pods while the live ones stay within want + maxSurge (all of them when no
            # old pod is left), then old ones while Ready pods stay at want - maxUnavailable
            # (an old pod that is not Ready goes at once: it serves nothing).
            room = want - len(new) if not old else min(want - len(new), want + surge - len(live))
            for _ in range(max(room, 0)):
                await self._create_pod(dep, current_hash)
            ready = sum(_ready(p) for p in live)
            for pod in sorted(old, key=_ready):
                if _ready(pod) and ready - 1 < want - unavailable:
                    break
                ready -= _ready(pod)
                await self.api.delete("v1", "pods", ns, pod["metadata"]["name"])
        for pod in sorted(new, key=lambda p: p["metadata"]["name"])[want:]:
            await self.api.delete("v1", "pods", ns, pod["metadata"]["name"])
        await self._write_status(dep, want, live, new)

    async def _create_pod(self, dep: Obj, current_hash: str) -> None:
        meta, template = dep["metadata"], (dep.get("spec") or {}).get("template") or {}
        labels = {**((template.get("metadata") or {}).get("labels") or {})}
        labels["pod-template-hash"] = current_hash
        name = f"{meta['name']}-{current_hash}-{secrets.token_hex(3)[:5]}"
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": meta["namespace"],
                "labels": labels,
                "ownerReferences": [
                    {
                        "apiVersion": "apps/v1",
                        "kind": "Deployment",
                        "name": meta["name"],
                        "uid": meta["uid"],
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "spec": json.loads(json.dumps(template.get("spec") or {})),
        }
        logger.info("deployment %s: creating pod %s", meta["name"], name)
        await self.api.create("v1", "pods", meta["namespace"], pod)

    async def _write_status(
        self, dep: Obj, want: int, live: Sequence[Obj], new: Sequence[Obj]
    ) -> None:
        ready = sum(_ready(p) for p in live)
        status = {
            "observedGeneration": dep["metadata"].get("generation", 1),
            "replicas": len(live),
            "updatedReplicas": len(new),
            "readyReplicas": ready,
            "availableReplicas": ready,
            "unavailableReplicas": max(want - ready, 0),
            "conditions": [
                {
                    "type": "Available",
                    "status": "True" if ready >= want else "False",
                    "reason": "MinimumReplicasAvailable"
                    if ready >= want
                    else "MinimumReplicasUnavailable",
                }
            ],
        }
        if (dep.get("status") or {}) != status:
            meta = dep["metadata"]
            await self.api.patch(
                "apps/v1",
                "deployments",
                meta["namespace"],
                meta["name"],
                {"status": status},
                "status",
            )


def _names(service: str, namespace: str) -> list[str]:
    return [
        service,
        f"{service}.{namespace}",
        f"{service}.{namespace}.svc",
        f"{service}.{namespace}.svc.cluster.local",
    ]


def hosts_entries(services: Sequence[Obj], pods: Sequence[Obj]) -> list[tuple[str, str, str]]:
    """(namespace, address, name) for every DNS name a pod may look up.

    The namespace says where the short forms (`svc`, `svc.ns`) apply: a pod resolves them only
    for Services of its own namespace.
    """
    entries: list[tuple[str, str, str]] = []
    for svc in services:
        ns, name = svc["metadata"]["namespace"], svc["metadata"]["name"]
        spec = svc.get("spec") or {}
        selector = spec.get("selector") or {}
        if not selector:
            continue
        not_ready_too = bool(spec.get("publishNotReadyAddresses"))
        headless = spec.get("clusterIP") == "None"
        for pod in pods:
            ip = (pod.get("status") or {}).get("podIP")
            if not ip or _terminating(pod) or not _selected(pod, selector, ns):
                continue
            if not (_ready(pod) or not_ready_too):
                continue
            entries += [(ns, ip, n) for n in _names(name, ns)]
            hostname = (pod.get("spec") or {}).get("hostname")
            if headless and hostname and (pod.get("spec") or {}).get("subdomain") == name:
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
