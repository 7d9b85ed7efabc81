"""A local kubelet: one node that schedules, runs and reports pods, plus the controllers.

`Kubelet` runs in a thread of its own with its own event loop (like the API server beside it)
and talks to the API server only over HTTP. Every `sync_interval` it lists pods, Services and
Deployments (a list, not a watch: simpler, and the emulator answers in about a millisecond) and:

1. schedules unbound pods onto its node — a pod whose `nodeSelector` does not match the node's
   labels, or that asks for `nvidia.com/gpu` (this node has none), stays Pending with the
   scheduler's `PodScheduled=False/Unschedulable` condition and message; CPU and memory requests
   are not enforced (a development node shares its cores);
2. starts a `PodWorker` for each pod bound to it (sandbox, container, probes, restarts) and
   tells the workers of deletions;
3. runs the Deployment controller;
4. rewrites every pod's /etc/hosts when Service membership changes, and the node's own hosts
   file (fully qualified names only) for processes run on the node with that view.

`stop()` stops every container (SIGTERM, then SIGKILL after `stop_grace`), removes every
namespace and the bridge, and ends the thread; it also runs when the harness fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pathlib
import platform
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from container_spec import Image
from controllers import DeploymentController, hosts_entries, hosts_file
from kubeapi import KubeApi
from netns import PodNetwork
from pod_status import unschedulable
from pod_worker import PodWorker

logger = logging.getLogger("kubelet")
NODE = "corefleet-local"
GPU = "nvidia.com/gpu"


def node_labels() -> dict[str, str]:
    """The well-known labels of this node."""
    arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
    return {"kubernetes.io/arch": arch, "kubernetes.io/os": "linux", "kubernetes.io/hostname": NODE}


def why_unschedulable(pod: Mapping[str, Any], labels: Mapping[str, str]) -> str | None:
    """The scheduler's message for a pod this node cannot take, or None."""
    spec = pod.get("spec") or {}
    selector = spec.get("nodeSelector") or {}
    if any(labels.get(k) != v for k, v in selector.items()):
        return "0/1 nodes are available: 1 node(s) didn't match Pod's node affinity/selector."
    for container in spec.get("containers") or ():
        resources = container.get("resources") or {}
        asked = (resources.get("limits") or {}).get(GPU) or (resources.get("requests") or {}).get(
            GPU
        )
        if asked and int(asked) > 0:
            return f"0/1 nodes are available: 1 Insufficient {GPU}."
    return None


class Kubelet:
    """The node: scheduling, pod workers, Deployments and DNS; see the module docstring."""

    def __init__(
        self,
        api_url: str,
        root: pathlib.Path,
        images: list[Image],
        backoff_base: float = 10.0,
        probe_period_cap: float = 1.0,
        sync_interval: float = 0.2,
        stop_grace: float = 10.0,
    ) -> None:
        self.api_url, self.root, self.images = api_url, root, images
        self.backoff_base, self.probe_period_cap = backoff_base, probe_period_cap
        self.sync_interval, self.stop_grace = sync_interval, stop_grace
        self.labels = node_labels()
        self.node_hosts = root / "node-hosts"
        self.workers: dict[str, PodWorker] = {}  # by pod uid
        self.network: PodNetwork | None = None
        self.errors: list[str] = []
        self._thread = threading.Thread(target=self._main, name="local-kubelet", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._hosts_written: dict[str, str] = {}
        self._entries: list[tuple[str, str, str]] = []  # the latest DNS records

    # --- lifecycle (called from the test thread)
    def start(self) -> None:
        """Create the pod network and start syncing."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.node_hosts.write_text("127.0.0.1 localhost\n")
        self.network = PodNetwork()
        self._thread.start()
        if not self._started.wait(10):
            raise TimeoutError("the local kubelet did not start")

    def stop(self) -> None:
        """Stop every container, remove every sandbox and the bridge."""
        logger.info("node stopping: %d pod(s)", len(self.workers))
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(self.stop_grace + 30)
            if self._thread.is_alive():
                self.errors.append("the kubelet thread did not stop in time")
        if self.network is not None:
            self.network.close()
        logger.info("node stopped")

    # --- what tests ask
    def worker(self, namespace: str, name: str) -> PodWorker | None:
        """The worker of a live pod by name (the newest if several)."""
        found = [
            w
            for w in self.workers.values()
            if (w.namespace, w.name) == (namespace, name) and not w.deleting.is_set()
        ]
        return found[-1] if found else None

    def log(self, namespace: str, name: str) -> str:
        """A pod's container output (all its runs), or '' when it has none."""
        path = self.root / "logs" / f"{namespace}_{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def namespaces(self) -> list[str]:
        """The network namespaces of live sandboxes."""
        return list(self.network.sandboxes) if self.network else []

    # --- the thread
    def _main(self) -> None:
        asyncio.run(self._run())

    async def _run(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        tasks: dict[str, asyncio.Task[None]] = {}
        async with KubeApi(self.api_url) as api:
            deployments = DeploymentController(api)
            self._started.set()
            while not self._stop.is_set():
                try:
                    await self._sync(api, deployments, tasks)
                except Exception as exc:  # keep the node alive; the test sees `errors`
                    logger.exception("kubelet sync failed")
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self.sync_interval)
            await self._shutdown(tasks)

    async def _sync(
        self, api: KubeApi, deployments: DeploymentController, tasks: dict[str, asyncio.Task[None]]
    ) -> None:
        pods = await api.list("v1", "pods")
        for pod in pods:
            if not (pod.get("spec") or {}).get("nodeName") and not pod["metadata"].get(
                "deletionTimestamp"
            ):
                await self._schedule(api, pod)
        by_uid = {p["metadata"]["uid"]: p for p in pods}
        for uid, pod in by_uid.items():
            if (pod.get("spec") or {}).get("nodeName") != NODE:
                continue
            if uid not in self.workers and not pod["metadata"].get("deletionTimestamp"):
                self._start_worker(api, pod, tasks)
            if uid in self.workers:
                self.workers[uid].update(pod)
        for uid, worker in self.workers.items():
            if uid not in by_uid and not worker.deleting.is_set():
                worker.grace_seconds = 0.0  # force-deleted: the container is killed at once
                worker.deleting.set()
        for uid in [u for u, t in tasks.items() if t.done()]:
            tasks.pop(uid)
            self.workers.pop(uid, None)
        await deployments.sync(await api.list("apps/v1", "deployments"), pods)
        self._write_dns(await api.list("v1", "services"), pods)

    async def _schedule(self, api: KubeApi, pod: Mapping[str, Any]) -> None:
        meta = pod["metadata"]
        reason = why_unschedulable(pod, self.labels)
        if reason is None:
            await api.patch(
                "v1", "pods", meta["namespace"], meta["name"], {"spec": {"nodeName": NODE}}
            )
            return
        conditions = (pod.get("status") or {}).get("conditions") or []
        if not any(c.get("message") == reason for c in conditions):
            await api.patch(
                "v1",
                "pods",
                meta["namespace"],
                meta["name"],
                {"status": unschedulable(reason)},
                "status",
            )

    def _start_worker(
        self, api: KubeApi, pod: Mapping[str, Any], tasks: dict[str, asyncio.Task[None]]
    ) -> None:
        assert self.network is not None
        worker = PodWorker(
            pod,
            api,
            self.network,
            self.images,
            self.root,
            self.network.gateway,
            self.backoff_base,
            self.probe_period_cap,
            self._write_pod_hosts,
        )
        uid = pod["metadata"]["uid"]
        self.workers[uid] = worker
        tasks[uid] = asyncio.get_running_loop().create_task(worker.run(), name=worker.name)
        tasks[uid].add_done_callback(self._report_crash)

    def _report_crash(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.errors.append(f"pod worker {task.get_name()}: {task.exception()!r}")

    def _write_dns(self, services: Sequence[Mapping[str, Any]], pods: Sequence[Any]) -> None:
        self._entries = hosts_entries(services, pods)
        self._write_once(str(self.node_hosts), hosts_file(self._entries, None), self.node_hosts)
        for worker in self.workers.values():
            if not worker.deleting.is_set():
                self._write_pod_hosts(worker)

    def _write_pod_hosts(self, worker: PodWorker) -> None:
        box = worker.sandbox
        if box is None:
            return
        hostname = (worker.pod.get("spec") or {}).get("hostname") or worker.name
        text = hosts_file(self._entries, worker.namespace, (box.ip, hostname))
        if self._hosts_written.get(box.netns) != text:
            box.write_hosts(text)
            self._hosts_written[box.netns] = text

    def _write_once(self, key: str, text: str, path: pathlib.Path) -> None:
        if self._hosts_written.get(key) != text:
            with open(path, "w") as handle:  # in place: see Sandbox.write_hosts
                handle.write(text)
            self._hosts_written[key] = text

    async def _shutdown(self, tasks: dict[str, asyncio.Task[None]]) -> None:
        for worker in self.workers.values():
            worker.grace_seconds = min(worker.grace_seconds, self.stop_grace)
            worker.deleting.set()
        if tasks:
            await asyncio.wait(list(tasks.values()), timeout=self.stop_grace + 20)
        for task in tasks.values():
            task.cancel()
