"""A stand-in for the scheduler's binding and the kubelet's pod termination, on a real server.

A real API server deletes a pod that is on no node at once: only a scheduled pod terminates
gracefully (`deletionTimestamp` set, the pod kept until its kubelet has stopped the containers and
deletes it with `gracePeriodSeconds=0`). Scenarios that watch pods drain need that, without a
node that runs anything. `StandInKubelet` registers a Node object, binds every unscheduled pod of
the namespace to it (`pods/binding`, as the scheduler does), and finishes each pod's deletion
`termination_seconds` after it sees the `deletionTimestamp` (the final DELETE, with the pod's uid
as a precondition, as the kubelet sends it). `finalized` keeps each pod's last state before that
DELETE. Pod status (Running, Ready) stays the test's: it plays the kubelet's status updates.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp

NODE = "stand-in"
PODS = "/api/v1/namespaces/{ns}/pods"


class StandInKubelet:
    """Bind and finish terminating the pods of one namespace; `run()` until cancelled."""

    def __init__(
        self,
        url: str,
        session: aiohttp.ClientSession,
        termination_seconds: float,
        namespace: str = "default",
        interval: float = 0.1,
    ) -> None:
        self.url, self.session = url, session
        self.termination_seconds, self.interval = termination_seconds, interval
        self.pods = PODS.format(ns=namespace)
        self.finalized: list[dict[str, Any]] = []
        self._terminating: dict[str, float] = {}  # uid -> when first seen terminating

    async def _call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        async with self.session.request(method, self.url + path, json=body) as resp:
            return resp.status, await resp.json(content_type=None)

    async def register(self) -> None:
        """Create the Node the pods are bound to (the pod garbage collector deletes pods bound
        to a node that does not exist)."""
        status, answer = await self._call("POST", "/api/v1/nodes", {"metadata": {"name": NODE}})
        assert status in (201, 409), answer

    async def run(self) -> None:
        """Poll the namespace's pods until cancelled."""
        await self.register()
        while True:
            status, listed = await self._call("GET", self.pods)
            assert status == 200, listed
            for pod in listed.get("items") or []:
                await self._tend(pod)
            await asyncio.sleep(self.interval)

    async def _tend(self, pod: dict[str, Any]) -> None:
        meta, spec = pod["metadata"], pod.get("spec") or {}
        name, uid = meta["name"], meta["uid"]
        if not meta.get("deletionTimestamp"):
            if not spec.get("nodeName"):
                binding = {
                    "apiVersion": "v1",
                    "kind": "Binding",
                    "metadata": {"name": name},
                    "target": {"apiVersion": "v1", "kind": "Node", "name": NODE},
                }
                status, answer = await self._call("POST", f"{self.pods}/{name}/binding", binding)
                assert status in (201, 404, 409), answer  # gone or bound meanwhile: fine
            return
        first = self._terminating.setdefault(uid, time.monotonic())
        if time.monotonic() - first < self.termination_seconds:
            return
        options = {"gracePeriodSeconds": 0, "preconditions": {"uid": uid}}
        status, answer = await self._call("DELETE", f"{self.pods}/{name}", options)
        assert status in (200, 404, 409), answer
        if status == 200:
            self.finalized.append(pod)
        self._terminating.pop(uid, None)
