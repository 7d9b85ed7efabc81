"""The container mode: a pod's container runs from its image under runc.

For each run of a container: the image's layers (Docker's store, `docker_images`) under a
writable layer of the run, mounted as overlayfs at the bundle's rootfs; a config.json from the
pod (`oci_spec`); then `runc run` in the foreground, so the process the worker waits for is
runc, whose exit status is the container's. Stopping is `runc kill` with SIGTERM, then SIGKILL
to every process of the container after the grace period, as a kubelet's runtime does; removal
is `runc delete`, the unmount and the run's folder.

runc keeps its state under /run/corefleet-runc/<pid of the harness, hex>, and rootfs mount
points carry the same tag: `remove_leftovers` deletes what a dead harness left behind.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import pathlib
import re
import shutil
import subprocess
from collections.abc import Mapping
from typing import Any

from container_runtime import ContainerRequest
from container_spec import ContainerConfigError, resolve_env, volume_sources
from docker_images import ImageConfig, inspect_image
from netns import pid_alive
from oci_spec import argv, mounts, oci_config, run_as

logger = logging.getLogger("kubelet")
RUNC = shutil.which("runc") or "/usr/sbin/runc"
STATE_ROOT = pathlib.Path("/run/corefleet-runc")
TERMINATION_MESSAGE_BYTES = 4096
_TAGGED = re.compile(r"cfrootfs-([0-9a-f]+)-")


def _runc(root: pathlib.Path, *args: str, check: bool = False) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [RUNC, "--root", str(root), *args], capture_output=True, text=True, timeout=60
    )
    if check and done.returncode != 0:
        raise ContainerConfigError("RunContainerError", f"runc {args[0]}: {done.stderr.strip()}")
    return done


def remove_leftovers() -> None:
    """Kill and delete the containers, and unmount the root filesystems, of dead harnesses."""
    for root in STATE_ROOT.glob("*") if STATE_ROOT.exists() else ():
        if re.fullmatch(r"[0-9a-f]+", root.name) and not pid_alive(int(root.name, 16)):
            listed = _runc(root, "list", "--quiet").stdout.split()
            for container_id in listed:
                _runc(root, "kill", "--all", container_id, "KILL")
                _runc(root, "delete", "--force", container_id)
            shutil.rmtree(root, ignore_errors=True)
    for line in pathlib.Path("/proc/self/mounts").read_text().splitlines():
        target = line.split()[1]
        match = _TAGGED.search(target)
        if match and not pid_alive(int(match.group(1), 16)):
            subprocess.run(["umount", "-l", target], capture_output=True, timeout=60)


class RuncContainer:
    """One run: runc's process, its state and its root filesystem."""

    def __init__(
        self, root: pathlib.Path, container_id: str, run_dir: pathlib.Path, rootfs: pathlib.Path,
        termination_log: pathlib.Path, process: subprocess.Popen[bytes], label: str,
    ) -> None:  # fmt: skip
        self.root, self.id, self.run_dir, self.rootfs = root, container_id, run_dir, rootfs
        self.termination_log, self.process, self.label = termination_log, process, label
        self._removed = False

    @property
    def pid(self) -> int | None:
        if self.process.poll() is not None:
            return None
        done = _runc(self.root, "state", self.id)
        if done.returncode != 0:
            return None
        state = json.loads(done.stdout)
        return int(state["pid"]) if state.get("status") == "running" else None

    async def stop(self, grace_seconds: float) -> None:
        if self.process.poll() is None:
            await asyncio.to_thread(_runc, self.root, "kill", self.id, "TERM")
            try:
                await asyncio.to_thread(self.process.wait, grace_seconds)
            except subprocess.TimeoutExpired:
                logger.info("%s: grace period over; SIGKILL", self.label)
        await asyncio.to_thread(_runc, self.root, "kill", "--all", self.id, "KILL")
        await asyncio.to_thread(self.process.wait)

    def termination_message(self) -> str:
        try:
            with open(self.termination_log, "rb") as handle:
                return handle.read(TERMINATION_MESSAGE_BYTES).decode(errors="replace")
        except OSError:
            return ""

    async def remove(self) -> None:
        if self._removed:
            return
        self._removed = True
        await asyncio.to_thread(self._remove)

    def _remove(self) -> None:
        _runc(self.root, "delete", "--force", self.id)
        subprocess.run(["umount", "-l", str(self.rootfs)], capture_output=True, timeout=60)
        shutil.rmtree(self.run_dir / "bundle", ignore_errors=True)
        shutil.rmtree(self.run_dir / "layer", ignore_errors=True)


class RuncRuntime:
    """Starts containers from the local Docker engine's images under runc."""

    def __init__(self) -> None:
        remove_leftovers()
        self.tag = f"{os.getpid():x}"
        self.root = STATE_ROOT / self.tag
        self.root.mkdir(parents=True, exist_ok=True)
        self._runs = itertools.count(1)

    async def start(self, request: ContainerRequest) -> RuncContainer:
        pod = request.pod
        spec = pod.get("spec") or {}
        container = (spec.get("containers") or [{}])[0]
        policy = container.get("imagePullPolicy") or "IfNotPresent"
        image = await asyncio.to_thread(inspect_image, container.get("image", ""), policy)
        n = next(self._runs)
        run_dir = request.pod_dir / f"run-{n}"
        rootfs = run_dir / "bundle" / f"cfrootfs-{self.tag}-{n}"
        await asyncio.to_thread(self._mount_rootfs, image, run_dir, rootfs)
        try:
            config, termination_log = await self._config(request, container, image, rootfs, n)
        except BaseException:
            subprocess.run(["umount", "-l", str(rootfs)], capture_output=True, timeout=60)
            raise
        (run_dir / "bundle" / "config.json").write_text(json.dumps(config))
        container_id = f"cf-{self.tag}-{n}-{pod['metadata']['name']}"[:120]
        process = subprocess.Popen(
            [RUNC, "--root", str(self.root), "run", "--bundle", str(run_dir / "bundle"),
             container_id],
            stdin=subprocess.DEVNULL, stdout=request.log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        label = f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"
        return RuncContainer(
            self.root, container_id, run_dir, rootfs, termination_log, process, label
        )

    @staticmethod
    def _mount_rootfs(image: ImageConfig, run_dir: pathlib.Path, rootfs: pathlib.Path) -> None:
        upper, work = run_dir / "layer" / "upper", run_dir / "layer" / "work"
        for folder in (upper, work, rootfs):
            folder.mkdir(parents=True, exist_ok=True)
        options = f"lowerdir={':'.join(image.layers)},upperdir={upper},workdir={work}"
        done = subprocess.run(
            ["mount", "-t", "overlay", "overlay", "-o", options, str(rootfs)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        if done.returncode != 0:
            raise ContainerConfigError(
                "CreateContainerError", f"root filesystem: {done.stderr.strip()}"
            )

    async def _config(
        self, request: ContainerRequest, container: Mapping[str, Any], image: ImageConfig,
        rootfs: pathlib.Path, n: int,
    ) -> tuple[dict[str, Any], pathlib.Path]:  # fmt: skip
        pod, box = request.pod, request.sandbox
        hostname = (pod.get("spec") or {}).get("hostname") or pod["metadata"]["name"]
        base = {**dict(image.env), "HOSTNAME": hostname}
        env = await resolve_env(pod, container, base, box.ip, request.host_ip, request.fetch)
        user = run_as(pod, container, image, rootfs)
        volumes = await volume_sources(
            pod, container, request.pod_dir, request.fetch, request.token_for
        )
        termination_log = request.pod_dir / f"termination-log-{n}"
        termination_log.touch()
        termination_log.chmod(0o666)  # whichever user the container runs as writes it
        mount_list = mounts(pod, container, volumes, box.etc, termination_log)
        process_argv = argv(container, image, env)
        cgroup = f"/corefleet/{self.tag}-{n}"
        config = oci_config(
            pod, container, image, process_argv, env, user, rootfs, mount_list,
            box.netns, hostname, cgroup,
        )  # fmt: skip
        return config, termination_log
