"""One pod on the local node: its sandbox, its container's runs, probes, restarts, termination.

The life of a pod, as a kubelet lives it:
    sandbox (namespace + address) → resolve the container (env, mounts, image) → start →
    probe readiness/liveness over HTTP at the pod's address → on exit, restart with back-off
    (`restartPolicy: Always`: the first crash restarts at once, later ones wait `backoff_base`,
    doubling up to 300 s, in CrashLoopBackOff; a run of 60 s resets the back-off) → on
    deletion: SIGTERM, wait the grace period, SIGKILL the process group, remove the sandbox,
    and delete the pod object with grace 0 (the final delete).
Every change is reported by merge-patching `pods/<name>/status`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pathlib
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

import aiohttp
from container_runtime import Container, ContainerRequest, Runtime
from container_spec import ContainerConfigError
from kubeapi import KubeApi
from netns import PodNetwork, Sandbox
from pod_status import ContainerState, now, pod_status, terminated

logger = logging.getLogger("kubelet")
MAX_BACKOFF_S = 300.0
BACKOFF_RESET_AFTER_S = 60.0


class PodWorker:
    """Runs one pod until it is deleted; `run()` is its whole life."""

    def __init__(
        self,
        pod: Mapping[str, Any],
        api: KubeApi,
        network: PodNetwork,
        runtime: Runtime,
        root: pathlib.Path,
        host_ip: str,
        backoff_base: float,
        probe_period_cap: float,
        write_dns: Callable[[PodWorker], None],
    ) -> None:
        meta = pod["metadata"]
        self.pod: Mapping[str, Any] = pod
        self.namespace, self.name, self.uid = meta["namespace"], meta["name"], meta["uid"]
        self.api, self.network, self.runtime = api, network, runtime
        self.dir = root / f"{self.namespace}_{self.name}_{self.uid[:8]}"
        self.log_path = root / "logs" / f"{self.namespace}_{self.name}.log"
        self.host_ip, self.backoff_base = host_ip, backoff_base
        self.probe_period_cap = probe_period_cap
        self.write_dns = write_dns
        spec = pod.get("spec") or {}
        first = (spec.get("containers") or [{}])[0]
        self.container = ContainerState(
            name=first.get("name", "main"), image=first.get("image", "")
        )
        self.sandbox: Sandbox | None = None
        self.running: Container | None = None  # the container's latest run
        self.deleting = asyncio.Event()
        self.grace_seconds = float(spec.get("terminationGracePeriodSeconds", 30))
        self.start_time = now()
        self._phase = "Pending"
        self._runs = 0  # container starts so far

    # --- what the kubelet's loop tells the worker
    def update(self, pod: Mapping[str, Any]) -> None:
        """The latest object; a deletionTimestamp starts termination."""
        self.pod = pod
        meta = pod["metadata"]
        if meta.get("deletionTimestamp") and not self.deleting.is_set():
            grace = meta.get("deletionGracePeriodSeconds")
            if grace is not None:
                self.grace_seconds = float(grace)
            self.deleting.set()

    @property
    def pid(self) -> int | None:
        """The container's main process while it runs."""
        return self.running.pid if self.running else None

    @property
    def process(self) -> subprocess.Popen[bytes] | None:
        """What the worker waits for: the container's process (or its runtime's)."""
        return self.running.process if self.running else None

    # --- the life of the pod
    async def run(self) -> None:
        """Create the sandbox, run the container until deletion, then clean up."""
        try:
            await self._live()
        finally:
            await self._stop_container()
            if self.sandbox is not None:
                await asyncio.to_thread(self.network.destroy, self.sandbox)
            with contextlib.suppress(Exception):
                # By uid, as the kubelet does: a terminal pod is gone at once when deleted, and
                # a new pod of the same name may exist by now.
                await self.api.delete(
                    "v1", "pods", self.namespace, self.name, grace_seconds=0, uid=self.uid
                )

    async def _live(self) -> None:
        hostname = (self.pod.get("spec") or {}).get("hostname") or self.name
        search = [f"{self.namespace}.svc.cluster.local", "svc.cluster.local", "cluster.local"]
        self.sandbox = await asyncio.to_thread(self.network.create, self.name, hostname, search)
        self.write_dns(self)  # the Service names resolve from the container's first instant
        await self._report()
        backoff = 0.0  # a first crash restarts at once, as the kubelet does; then it backs off
        while not self.deleting.is_set():
            started = time.monotonic()
            exited = await self._run_once()
            if not exited:
                return
            if "waiting" in self.container.state:
                # Not created (a config error, a missing image): retried with back-off whatever
                # the restart policy, as the kubelet does; the pod stays Pending meanwhile.
                await self._back_off(backoff or self.backoff_base)
                backoff = min(max(backoff * 2, self.backoff_base), MAX_BACKOFF_S)
                continue
            policy = (self.pod.get("spec") or {}).get("restartPolicy", "Always")
            code = self.container.last_state.get("terminated", {}).get("exitCode", 1)
            if policy == "Never" or (policy == "OnFailure" and code == 0):
                self._phase = "Succeeded" if code == 0 else "Failed"
                self.container.state = {"terminated": self.container.last_state["terminated"]}
                self.container.last_state = {}
                await self._report()
                await self.deleting.wait()
                return
            if time.monotonic() - started > BACKOFF_RESET_AFTER_S:
                backoff = 0.0
            if backoff > 0 or "waiting" in self.container.state:
                await self._back_off(backoff or self.backoff_base)
            backoff = min(max(backoff * 2, self.backoff_base), MAX_BACKOFF_S)

    async def _run_once(self) -> bool:
        """Start the container and wait; True if it exited by itself (or failed to start)."""
        assert self.sandbox is not None
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(self.log_path, "ab") as log:
                request = ContainerRequest(
                    self.pod, self.sandbox, self.host_ip, self.dir, self._fetch, self._token, log
                )
                self.running = await self.runtime.start(request)
        except ContainerConfigError as exc:
            self.container.state = {"waiting": {"reason": exc.reason, "message": str(exc)}}
            await self._report()
            return True
        if self._runs:
            self.container.restart_count += 1  # counts restarts, not exits, as Kubernetes does
        self._runs += 1
        started_at = now()
        self._phase = "Running"
        self.container.state = {"running": {"startedAt": started_at}}
        self.container.ready = not self._probe("readinessProbe")
        await self._report()
        await self._watch(started_at)
        if self.deleting.is_set():
            return False
        assert self.running is not None
        rc = self.running.process.returncode
        state = terminated(rc, started_at)
        message = self.running.termination_message()
        if message:
            state["message"] = message
        await self.running.remove()
        self.container.last_state = {"terminated": state}
        self.container.ready = False
        logger.info("%s/%s: container exited with %s", self.namespace, self.name, rc)
        return True

    async def _watch(self, started_at: str) -> None:
        """Probe while the process runs; a failed liveness probe kills it (then it restarts)."""
        process = self.process
        assert process is not None
        readiness, liveness = self._probe("readinessProbe"), self._probe("livenessProbe")
        fails = {"readinessProbe": 0, "livenessProbe": 0}
        started, last = time.monotonic(), {"readinessProbe": 0.0, "livenessProbe": 0.0}
        while process.poll() is None and not self.deleting.is_set():
            await asyncio.sleep(0.1)
            for kind, probe in (("readinessProbe", readiness), ("livenessProbe", liveness)):
                if probe is None or not self._due(kind, probe, started, last[kind]):
                    continue
                last[kind] = time.monotonic()
                ok = await self._check(probe)
                fails[kind] = 0 if ok else fails[kind] + 1
                failed = fails[kind] >= int(probe.get("failureThreshold", 3))
                if kind == "readinessProbe" and (ok or failed) and ok != self.container.ready:
                    self.container.ready = ok
                    await self._report()
                if kind == "livenessProbe" and failed:
                    logger.info("%s/%s: liveness probe failed; killing", self.namespace, self.name)
                    await self._stop_container()
        if self.deleting.is_set():
            return
        await asyncio.to_thread(process.wait)

    def _probe(self, kind: str) -> Mapping[str, Any] | None:
        containers = (self.pod.get("spec") or {}).get("containers") or [{}]
        probe = containers[0].get(kind)
        return probe if isinstance(probe, Mapping) and "httpGet" in probe else None

    def _due(self, kind: str, probe: Mapping[str, Any], started: float, last: float) -> bool:
        # Readiness probes run at least every `probe_period_cap` seconds, so the local node
        # reports a ready pod within a second instead of a 5-10 s period later. Liveness probes
        # keep their period: failureThreshold x periodSeconds is how long a container may be
        # unresponsive (while it starts, say) before it is killed, and that must not shrink.
        period = float(probe.get("periodSeconds", 10))
        if kind == "readinessProbe":
            period = min(period, self.probe_period_cap)
        delay = float(probe.get("initialDelaySeconds", 0))
        now_s = time.monotonic()
        return now_s - started >= delay and now_s - last >= period

    async def _check(self, probe: Mapping[str, Any]) -> bool:
        assert self.sandbox is not None
        get = probe["httpGet"]
        url = f"http://{self.sandbox.ip}:{self._port(get.get('port'))}{get.get('path', '/')}"
        timeout = aiohttp.ClientTimeout(total=float(probe.get("timeoutSeconds", 1)))
        try:
            async with (
                aiohttp.ClientSession(timeout=timeout) as session,
                session.get(url) as resp,
            ):
                return 200 <= resp.status < 400
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    def _port(self, port: Any) -> int:
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        containers = (self.pod.get("spec") or {}).get("containers") or [{}]
        for entry in containers[0].get("ports") or ():
            if entry.get("name") == port:
                return int(entry["containerPort"])
        return 0  # an unknown named port: the probe fails, as it would in a cluster

    async def _back_off(self, delay: float) -> None:
        waiting = {
            "reason": "CrashLoopBackOff",
            "message": f"back-off {delay:g}s restarting failed container={self.container.name} "
            f"pod={self.name}_{self.namespace}({self.uid})",
        }
        if self.container.state.get("waiting", {}).get("reason") == "ErrImagePull":
            waiting = {**self.container.state["waiting"], "reason": "ImagePullBackOff"}
        elif "waiting" in self.container.state:
            waiting = self.container.state["waiting"]  # a config error stays as it is
        self.container.state = {"waiting": waiting}
        await self._report()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.deleting.wait(), delay)

    async def _stop_container(self) -> None:
        """SIGTERM the main process, wait the grace period, then SIGKILL what is left."""
        if self.running is None:
            return
        await self.running.stop(self.grace_seconds)
        await self.running.remove()

    async def _fetch(self, plural: str, namespace: str, name: str) -> dict[str, Any] | None:
        return await self.api.get("v1", plural, namespace, name)

    async def _token(self, account: str, seconds: int, audiences: Sequence[str]) -> str:
        """A service-account token bound to this pod, from the TokenRequest API."""
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "audiences": list(audiences),
                "expirationSeconds": seconds,
                "boundObjectRef": {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": self.name,
                    "uid": self.uid,
                },
            },
        }
        path = f"/api/v1/namespaces/{self.namespace}/serviceaccounts/{account}/token"
        answer = await self.api.call("POST", path, body)
        return str(answer["status"]["token"])

    async def _report(self) -> None:
        ip = self.sandbox.ip if self.sandbox else None
        status = pod_status(self._phase, self.container, ip, self.host_ip, self.start_time)
        with contextlib.suppress(Exception):
            await self.api.patch(
                "v1", "pods", self.namespace, self.name, {"status": status}, "status"
            )

    def open_log(self) -> IO[str]:
        """The container's output so far (all runs)."""
        return open(self.log_path, errors="replace")
