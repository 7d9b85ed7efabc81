"""What a pod worker asks of a container runtime, whichever it is.

Two runtimes run pods' containers on the local node:
- `process_runtime.ProcessRuntime`: a container is a process of this machine's installation
  in the pod's namespaces (fast; most of the suite);
- `runc_runtime.RuncRuntime`: a container runs from its image, built by `make images` and held
  by the local Docker engine, under runc (the container mode, `docs/local-cluster.md`).

Both start the container's main process as a child the worker waits for, in the pod's network
namespace (`netns.Sandbox`), with its output appended to the pod's log file.
"""

from __future__ import annotations

import dataclasses
import pathlib
import subprocess
from collections.abc import Mapping
from typing import IO, Any, Protocol

from container_spec import Fetch
from netns import Sandbox
from pod_volumes import TokenFor


@dataclasses.dataclass(frozen=True)
class ContainerRequest:
    """Everything about the pod a runtime needs to start its (first) container."""

    pod: Mapping[str, Any]
    sandbox: Sandbox
    host_ip: str
    pod_dir: pathlib.Path  # the pod's own folder on the node (volumes, rootfs layers)
    fetch: Fetch
    token_for: TokenFor
    log: IO[bytes]


class Container(Protocol):
    """One run of a container: started, waited for, stopped, removed."""

    process: subprocess.Popen[bytes]  # what the worker waits for; its exit is the container's

    @property
    def pid(self) -> int | None:
        """The container's main process (as this machine sees it) while it runs."""

    async def stop(self, grace_seconds: float) -> None:
        """SIGTERM, then SIGKILL to everything in the container once the grace period is over."""

    def termination_message(self) -> str:
        """What the container wrote to its termination-message file (Kubernetes: 4096 bytes)."""

    async def remove(self) -> None:
        """Release what the run held (runtime state, mounts); the process has exited."""


class Runtime(Protocol):
    """Starts a pod's container (raises `ContainerConfigError` when it cannot be created)."""

    async def start(self, request: ContainerRequest) -> Container: ...
