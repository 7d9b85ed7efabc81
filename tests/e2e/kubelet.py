"""A local kubelet: one registered Node that runs the pods the real scheduler binds to it.

`Kubelet` runs in a thread of its own with its own event loop and talks to the API server only
over HTTPS, with the node's credentials (`system:node:corefleet-local` in `system:nodes`), so the
Node authorizer and NodeRestriction hold it to what a real kubelet may do. On start it registers
its Node (`node_object.py`: capacity, conditions, the log endpoint) and serves container logs
(`kubelet_server.py`); then it renews its Lease every `LEASE_RENEW_S` and every `sync_interval`
it lists its pods (`spec.nodeName` selected: the only list the Node authorizer allows a node)
and, as cluster DNS with a user of its own, Services and EndpointSlices (lists, not watches:
simpler, and cheap at these sizes), and:

1. starts a `PodWorker` for each pod bound to its node (sandbox, container, probes, restarts)
   and tells the workers of deletions;
2. rewrites every pod's /etc/hosts when Service membership changes, and the node's own hosts
   file (fully qualified names only) for processes run on the node with that view
   (`cluster_dns.py`).

Scheduling, Deployments, ReplicaSets, garbage collection and the HPA are the real
kube-scheduler's and kube-controller-manager's (`tests/controlplane/`).

`stop()` stops every container (SIGTERM, then SIGKILL after `stop_grace`), removes every
namespace and the bridge, and ends the thread; it also runs when the harness fails. The Node
object stays, as a node that was switched off stays: the next kubelet of this name takes it over.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pathlib
import ssl
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cluster_dns import hosts_entries, hosts_file
from container_runtime import Runtime
from kubeapi import KubeApi
from kubelet_server import KubeletServer
from netns import PodNetwork
from node_object import NODE, NodeSize, heartbeat, register, this_machine
from pod_worker import PodWorker

logger = logging.getLogger("kubelet")
LEASE_RENEW_S = 10.0


@dataclass(frozen=True)
class NodeIdentity:
    """How the node reaches the API server and how the API server reaches the node."""

    api_url: str
    client_tls: ssl.SSLContext  # the cluster CA and the node's client certificate
    server_tls: ssl.SSLContext  # the node's serving certificate; requires client certificates
    port: int  # where the node serves container logs, on 127.0.0.1
    dns_tls: ssl.SSLContext  # cluster DNS's own user: it reads Services and EndpointSlices


class Kubelet:
    """The node: registration, heartbeat, pod workers and DNS; see the module docstring."""

    def __init__(
        self,
        identity: NodeIdentity,
        root: pathlib.Path,
        runtime: Runtime,
        backoff_base: float = 10.0,
        probe_period_cap: float = 1.0,
        sync_interval: float = 0.2,
        stop_grace: float = 10.0,
        size: NodeSize | None = None,
    ) -> None:
        self.identity, self.root, self.runtime = identity, root, runtime
        self.backoff_base, self.probe_period_cap = backoff_base, probe_period_cap
        self.sync_interval, self.stop_grace = sync_interval, stop_grace
        self.size = size or this_machine()
        self.node_hosts = root / "node-hosts"
        self.workers: dict[str, PodWorker] = {}  # by pod uid
        self.network: PodNetwork | None = None
        self.errors: list[str] = []
        self._thread = threading.Thread(target=self._main, name="local-kubelet", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._hosts_written: dict[str, str] = {}
        self._entries: list[tuple[str, str, str]] = []  # the latest DNS records

    # --- lifecycle (called from the test thread)
    def start(self) -> None:
        """Create the pod network, register the Node and start syncing."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.node_hosts.write_text("127.0.0.1 localhost\n")
        self.network = PodNetwork()
        self._thread.start()
        if not self._started.wait(30):
            raise TimeoutError("the local kubelet did not start")
        if self._start_error is not None:
            raise RuntimeError(f"the local kubelet failed to start: {self._start_error!r}")

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
        path = self._log_file(namespace, name)
        return path.read_text(errors="replace") if path.exists() else ""

    def namespaces(self) -> list[str]:
        """The network namespaces of live sandboxes."""
        return list(self.network.sandboxes) if self.network else []

    def _log_file(self, namespace: str, name: str) -> pathlib.Path:
        return self.root / "logs" / f"{namespace}_{name}.log"

    def _live_log(self, namespace: str, name: str) -> pathlib.Path | None:
        live = any((w.namespace, w.name) == (namespace, name) for w in self.workers.values())
        return self._log_file(namespace, name) if live else None

    # --- the thread
    def _main(self) -> None:
        asyncio.run(self._run())

    async def _run(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        tasks: dict[str, asyncio.Task[None]] = {}
        identity = self.identity
        server = KubeletServer(identity.server_tls, identity.port, self._live_log)
        async with (
            KubeApi(identity.api_url, identity.client_tls) as api,
            KubeApi(identity.api_url, identity.dns_tls) as dns,
        ):
            try:
                await server.start()
                await register(api, "127.0.0.1", identity.port, self.size)
                await heartbeat(api)
            except BaseException as exc:
                self._start_error = exc
                self._started.set()
                await server.stop()
                return
            self._started.set()
            renewed = time.monotonic()
            while not self._stop.is_set():
                try:
                    if time.monotonic() - renewed >= LEASE_RENEW_S:
                        await heartbeat(api)
                        renewed = time.monotonic()
                    await self._sync(api, tasks)
                    await self._write_dns(dns)
                except Exception as exc:  # keep the node alive; the test sees `errors`
                    logger.exception("kubelet sync failed")
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self.sync_interval)
            await self._shutdown(tasks)
            await server.stop()

    async def _sync(self, api: KubeApi, tasks: dict[str, asyncio.Task[None]]) -> None:
        pods = await api.list("v1", "pods", query=f"fieldSelector=spec.nodeName%3D{NODE}")
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

    def _start_worker(
        self, api: KubeApi, pod: Mapping[str, Any], tasks: dict[str, asyncio.Task[None]]
    ) -> None:
        assert self.network is not None
        worker = PodWorker(
            pod,
            api,
            self.network,
            self.runtime,
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

    async def _write_dns(self, dns: KubeApi) -> None:
        services = await dns.list("v1", "services")
        slices = await dns.list("discovery.k8s.io/v1", "endpointslices")
        self._entries = hosts_entries(services, slices)
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
