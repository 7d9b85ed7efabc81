"""Test harness: the emulator served on loopback, the real operator, and a stand-in kubelet.

`cluster()` serves a `KubeEmu` with the InferenceEngine CRD registered and a kubeconfig pointing
at it (the operator logs in through KUBECONFIG, as `kopf run` would). `running_operator()` runs
`kopf.operator()` with corefleet's handlers in the current loop; enter it inside the test body
(kopf cancels tasks newer than itself on exit, which would include an async fixture's teardown).
Nothing runs the pods, so `Cluster.set_pod` plays the kubelet by patching `pods/<name>/status`.
Every wait has a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import aiohttp
import kopf
import yaml
from kubeemu import KubeEmu
from kubeemu_server import ServedInThread

REPO = pathlib.Path(__file__).resolve().parents[3]
CRD = yaml.safe_load((REPO / "crds" / "inferenceengines.corefleet.dev.yaml").read_text())
IE = "corefleet.dev/v1alpha1/inferenceengines"
IE_URL = "/apis/corefleet.dev/v1alpha1/namespaces/default/inferenceengines"
MERGE = {"Content-Type": "application/merge-patch+json"}
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


async def eventually(check: Callable[[], Any], timeout: float = 10.0, what: str = "") -> Any:
    """Poll `check` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or check}")
        await asyncio.sleep(0.02)


def _quiet_kopf_watch_close(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    # When the loop closes, asyncio finalizes kopf's watch-stream generators, and kopf 1.45's
    # `infinite_watch` answers aclose() with "generator didn't stop after athrow()". That is
    # noise from a finished operator, not a failure of the scenario; everything else is reported.
    generator = context.get("asyncgen")
    if getattr(generator, "__name__", "") == "infinite_watch":
        return
    loop.default_exception_handler(context)


def run(coro: Awaitable[Any], timeout: float = 60.0) -> Any:
    """Run a scenario in a fresh event loop with an overall timeout."""

    async def bounded() -> Any:
        asyncio.get_running_loop().set_exception_handler(_quiet_kopf_watch_close)
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


class Cluster:
    """The emulator plus HTTP helpers that act like kubectl, a kubelet and controllers."""

    def __init__(self, emu: KubeEmu, url: str, session: aiohttp.ClientSession) -> None:
        self.emu, self.url, self.session = emu, url, session

    async def request(
        self, method: str, url: str, body: Any = None, headers: Mapping[str, str] | None = None
    ) -> Any:
        """One API call; returns the decoded answer, failing on an unexpected status."""
        async with self.session.request(
            method, self.url + url, json=body, headers=dict(headers or {})
        ) as resp:
            data = await resp.json(content_type=None)
            assert resp.status < 300, (resp.status, data)
            return data

    def engine(self, name: str = "llama") -> dict[str, Any]:
        """The stored InferenceEngine."""
        obj = self.emu.obj(IE, "default", name)
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
            for p in self.emu.objs("v1/pods", "default")
            if p["metadata"]["labels"].get("corefleet.dev/engine") == name
        }

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

    async def coordinator_available(self, name: str = "llama") -> None:
        """Play the Deployment controller: one available coordinator pod."""
        await self.request(
            "PATCH",
            f"/apis/apps/v1/namespaces/default/deployments/{name}-coordinator/status",
            {"status": {"replicas": 1, "availableReplicas": 1}},
            MERGE,
        )

    async def all_ready(self, name: str = "llama") -> None:
        """Make the coordinator available and every rank pod Ready."""
        await self.coordinator_available(name)
        for pod in self.pods(name).values():
            await self.pod_ready(pod["metadata"]["name"])


def running_status(ready: bool) -> dict[str, Any]:
    """A pod status as the kubelet reports a running container (ready or loading)."""
    flag = "True" if ready else "False"
    return {
        "phase": "Running",
        "conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Ready", "status": flag},
        ],
        "containerStatuses": [
            {
                "name": "engine",
                "ready": ready,
                "restartCount": 0,
                "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}},
            }
        ],
    }


@contextlib.asynccontextmanager
async def cluster(kubeconfig: pathlib.Path, **emu_options: Any) -> AsyncIterator[Cluster]:
    """Serve an emulator with the CRD and a `default` namespace; KUBECONFIG points at it."""
    emu = KubeEmu(**emu_options)
    emu.register_crd(CRD)
    with ServedInThread(emu) as url:
        kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "emu",
                    "clusters": [{"name": "emu", "cluster": {"server": url}}],
                    "users": [{"name": "emu", "user": {"token": "test"}}],
                    "contexts": [
                        {
                            "name": "emu",
                            "context": {"cluster": "emu", "user": "emu", "namespace": "default"},
                        }
                    ],
                }
            )
        )
        os.environ["KUBECONFIG"] = str(kubeconfig)
        async with aiohttp.ClientSession() as session:
            harness = Cluster(emu, url, session)
            await harness.request("POST", "/api/v1/namespaces", {"metadata": {"name": "default"}})
            yield harness


@contextlib.asynccontextmanager
async def running_operator(**options: Any) -> AsyncIterator[asyncio.Task[None]]:
    """Run corefleet's kopf operator until the block ends; it must stop within 15 s."""
    import corefleet.operator.main  # noqa: F401  (registers the handlers)

    stop, ready = asyncio.Event(), asyncio.Event()
    settings = kopf.OperatorSettings()
    # kopf waits for idle per-object workers on exit; they idle out after this (default 5 s).
    settings.queueing.idle_timeout = 0.3
    settings.posting.idle_timeout = 0.3
    options.setdefault("settings", settings)
    options.setdefault("namespaces", ["default"])
    options.setdefault("standalone", True)
    task = asyncio.create_task(kopf.operator(stop_flag=stop, ready_flag=ready, **options))
    await asyncio.wait_for(ready.wait(), 10)
    try:
        yield task
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)


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


def events(cluster: Cluster, reason: str) -> list[dict[str, Any]]:
    """Kubernetes Events with a reason, posted about InferenceEngines."""
    return [
        e
        for e in cluster.emu.objs("v1/events", "default")
        if e.get("reason") == reason and e["involvedObject"]["kind"] == "InferenceEngine"
    ]
