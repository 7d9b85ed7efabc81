"""Test harness: what every operator scenario uses, whichever API server it runs against.

A scenario runs against a real control plane (`real_cluster.real_cluster()`: kube-apiserver,
optionally the controller manager and the scheduler; the operator logs in as the chart's
ServiceAccount) or, for a fault a real server will not produce on demand, against the emulator
(`emulated_cluster.emulated_cluster()`). Both give a `Cluster`: HTTP helpers that act like
kubectl, a kubelet and controllers, and reads of the stored objects, as the test's admin.
`operator_run.running_operator()` runs corefleet's kopf operator in the test's event loop.

Reads (`obj`, `objs`, `engine`, `pods`, ...) are synchronous: `eventually` runs its check in a
worker thread, so that polling the real server never stalls the operator sharing the loop.
Every wait has a timeout; nothing sleeps a fixed time and then asserts that nothing happened.
"""

from __future__ import annotations

import asyncio
import pathlib
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import aiohttp
import yaml

REPO = pathlib.Path(__file__).resolve().parents[3]
CRD = yaml.safe_load((REPO / "crds" / "inferenceengines.corefleet.dev.yaml").read_text())
IE = "corefleet.dev/v1alpha1/inferenceengines"
IE_URL = "/apis/corefleet.dev/v1alpha1/namespaces/default/inferenceengines"
MERGE = {"Content-Type": "application/merge-patch+json"}
RANK_SELECTOR = "corefleet.dev/engine={},app.kubernetes.io/component=engine"
CHILDREN = {  # resource path -> child names, for an engine called "llama"
    "v1/services": {"llama-coordinator", "llama-coordinators", "llama-engine"},
    "v1/configmaps": {"llama-engine-args"},
    "v1/secrets": {"llama-curve"},
    "apps/v1/deployments": {"llama-coordinator"},
    "policy/v1/poddisruptionbudgets": {"llama-engine", "llama-coordinator"},
    "networking.k8s.io/v1/networkpolicies": {"llama-coordinator"},
}


def engine_manifest(name: str = "llama", ranks: int = 2, **spec: Any) -> dict[str, Any]:
    """An InferenceEngine manifest with a small valid spec."""
    body = {
        "image": "corefleet:test",
        "model": {"path": "/models/smollm2"},
        "dataParallelSize": ranks,
        "resources": {"limits": {"nvidia.com/gpu": 1}},
        **spec,
    }
    return {
        "apiVersion": "corefleet.dev/v1alpha1",
        "kind": "InferenceEngine",
        "metadata": {"name": name, "namespace": "default"},
        "spec": body,
    }


async def eventually(check: Callable[[], Any], timeout: float = 30.0, what: str = "") -> Any:
    """Poll `check` (in a worker thread) until it returns something truthy; fail after
    `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = await asyncio.to_thread(check)
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or check}")
        await asyncio.sleep(0.05)


def _quiet_kopf_watch_close(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    # When the loop closes, asyncio finalizes kopf's watch-stream generators, and kopf 1.45's
    # `infinite_watch` answers aclose() with "generator didn't stop after athrow()". That is
    # noise from a finished operator, not a failure of the scenario; everything else is reported.
    generator = context.get("asyncgen")
    if getattr(generator, "__name__", "") == "infinite_watch":
        return
    loop.default_exception_handler(context)


def run(coro: Awaitable[Any], timeout: float = 120.0) -> Any:
    """Run a scenario in a fresh event loop with an overall timeout."""

    async def bounded() -> Any:
        asyncio.get_running_loop().set_exception_handler(_quiet_kopf_watch_close)
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


class Cluster:
    """An API server as the test's admin sees it; subclasses provide `obj`, `objs` and the
    HTTP session, and play the controllers that do not run there."""

    url: str
    session: aiohttp.ClientSession

    def obj(self, path: str, namespace: str, name: str) -> dict[str, Any] | None:
        """One stored object by resource path ("v1/pods"), namespace ("" when cluster-scoped)
        and name; None when it does not exist."""
        raise NotImplementedError

    def objs(self, path: str, namespace: str | None = None, selector: str = "") -> list[Any]:
        """Stored objects of a resource path (in one namespace; matching a label selector)."""
        raise NotImplementedError

    async def answer(
        self, method: str, url: str, body: Any = None, headers: Mapping[str, str] | None = None
    ) -> tuple[int, Any]:
        """One API call: (HTTP status, decoded answer)."""
        async with self.session.request(
            method, self.url + url, json=body, headers=dict(headers or {})
        ) as resp:
            return resp.status, await resp.json(content_type=None)

    async def request(
        self, method: str, url: str, body: Any = None, headers: Mapping[str, str] | None = None
    ) -> Any:
        """One API call; returns the decoded answer, failing on an unexpected status."""
        status, data = await self.answer(method, url, body, headers)
        assert status < 300, (method, url, status, data)
        return data

    def engine(self, name: str = "llama") -> dict[str, Any]:
        """The stored InferenceEngine."""
        obj = self.obj(IE, "default", name)
        assert obj is not None, f"{name} does not exist"
        return obj

    def status(self, name: str = "llama") -> dict[str, Any]:
        """The engine's status ({} when none yet)."""
        return self.engine(name).get("status") or {}

    def condition(self, kind: str, name: str = "llama") -> dict[str, Any]:
        """One condition of the engine's status ({} when absent)."""
        return next((c for c in self.status(name).get("conditions", []) if c["type"] == kind), {})

    def pods(self, name: str = "llama") -> dict[int, dict[str, Any]]:
        """rank -> pod of an engine."""
        return {
            int(p["metadata"]["labels"]["corefleet.dev/rank"]): p
            for p in self.objs("v1/pods", "default", RANK_SELECTOR.format(name))
        }

    def events(self, reason: str, name: str = "") -> list[dict[str, Any]]:
        """Kubernetes Events with a reason, posted about InferenceEngines (or one of them)."""
        return [
            e
            for e in self.objs("v1/events", "default")
            if e.get("reason") == reason
            and e["involvedObject"]["kind"] == "InferenceEngine"
            and (not name or e["involvedObject"]["name"] == name)
        ]

    async def apply(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        """Create an InferenceEngine."""
        return await self.request("POST", IE_URL, manifest)  # type: ignore[no-any-return]

    async def patch_spec(self, spec: Mapping[str, Any], name: str = "llama") -> None:
        """Merge-patch the engine's spec (like `kubectl patch --type merge`)."""
        await self.request("PATCH", f"{IE_URL}/{name}", {"spec": spec}, MERGE)

    async def scale(self, replicas: int, name: str = "llama") -> dict[str, Any]:
        """PATCH the scale subresource (like `kubectl scale --replicas`)."""
        return await self.request(  # type: ignore[no-any-return]
            "PATCH", f"{IE_URL}/{name}/scale", {"spec": {"replicas": replicas}}, MERGE
        )

    async def set_pod(self, pod: str, status: Mapping[str, Any]) -> None:
        """Play the kubelet: merge-patch a pod's status."""
        await self.request(
            "PATCH", f"/api/v1/namespaces/default/pods/{pod}/status", {"status": status}, MERGE
        )

    async def pod_ready(self, pod: str, ready: bool = True) -> None:
        """Mark a pod Running and (not) Ready."""
        await self.set_pod(pod, running_status(ready))

    async def coordinator_available(self, name: str = "llama", available: bool = True) -> None:
        """Play the Deployment controller: one (no) available coordinator pod."""
        count = int(available)  # a real server refuses more available than ready replicas
        status = {"replicas": 1, "readyReplicas": count, "availableReplicas": count}
        await self.request(
            "PATCH",
            f"/apis/apps/v1/namespaces/default/deployments/{name}-coordinator/status",
            {"status": status},
            MERGE,
        )

    async def all_ready(self, name: str = "llama") -> None:
        """Make the coordinator available and every rank pod Ready."""
        await self.coordinator_available(name)
        for pod in (await asyncio.to_thread(self.pods, name)).values():
            await self.pod_ready(pod["metadata"]["name"])


def running_status(ready: bool, container: str = "engine") -> dict[str, Any]:
    """A pod status as the kubelet reports a running container (ready or loading)."""
    flag = "True" if ready else "False"
    return {
        "phase": "Running",
        "conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Ready", "status": flag, "lastTransitionTime": "2026-01-01T00:00:00Z"},
        ],
        "containerStatuses": [
            {
                "name": container,
                "image": "corefleet:test",
                "imageID": "",
                "ready": ready,
                "restartCount": 0,
                "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}},
            }
        ],
    }


def _json_path(obj: Any, path: str) -> Any:
    # The two forms our printer columns use: `.a.b` and `.a[?(@.k=="v")].b`.
    for part in re.findall(r"\.([\w-]+)(\[\?\(@\.(\w+)==\"([^\"]*)\"\)\])?", path):
        name, _, key, value = part
        obj = obj.get(name) if isinstance(obj, Mapping) else None
        if key:
            obj = next((item for item in obj or [] if item.get(key) == value), None)
    return obj


def printer_columns(obj: Mapping[str, Any]) -> dict[str, Any]:
    """What `kubectl get ie` shows for an object, from the CRD's additionalPrinterColumns."""
    columns = CRD["spec"]["versions"][0]["additionalPrinterColumns"]
    return {c["name"].upper(): _json_path(obj, c["jsonPath"]) for c in columns}
