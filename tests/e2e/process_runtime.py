"""The process mode: a container is a process of this machine's corefleet installation.

The image is resolved by pattern to the node's installation plus a layer of files
(`container_spec.Image`); the container starts in the pod's network namespace with a private
mount namespace (`netns.Sandbox.spawn`). Fast to start, which is why most of the suite runs
this way; `runc_runtime` runs the real images.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess

from container_runtime import ContainerRequest
from container_spec import Image, find_image, plan_container

logger = logging.getLogger("kubelet")


class ProcessContainer:
    """A container that is one process group on the node."""

    def __init__(self, process: subprocess.Popen[bytes], label: str) -> None:
        self.process, self.label = process, label  # label: namespace/pod, for the log

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process.poll() is None else None

    async def stop(self, grace_seconds: float) -> None:
        """SIGTERM the main process, wait the grace period, then SIGKILL the whole group."""
        process = self.process
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGTERM)
            try:
                await asyncio.to_thread(process.wait, grace_seconds)
            except subprocess.TimeoutExpired:
                logger.info("%s: grace period over; SIGKILL", self.label)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)  # the container's stragglers, like a cgroup
        await asyncio.to_thread(process.wait)

    def termination_message(self) -> str:
        return ""  # the process shares the node's /dev: no termination-message file

    async def remove(self) -> None:
        return None


class ProcessRuntime:
    """Runs containers as processes of the images `images` stands for."""

    def __init__(self, images: list[Image]) -> None:
        self.images = images

    async def start(self, request: ContainerRequest) -> ProcessContainer:
        first = ((request.pod.get("spec") or {}).get("containers") or [{}])[0]
        image = find_image(first.get("image", ""), self.images)
        plan = await plan_container(
            request.pod,
            image,
            request.sandbox.ip,
            request.host_ip,
            request.pod_dir,
            request.fetch,
            request.token_for,
        )
        process = request.sandbox.spawn(plan.argv, plan.env, plan.mounts, plan.workdir, request.log)
        meta = request.pod["metadata"]
        return ProcessContainer(process, f"{meta['namespace']}/{meta['name']}")
