"""Pod status documents as a kubelet writes them (phase, conditions, container status)."""

from __future__ import annotations

import dataclasses
import datetime
import signal
from typing import Any


def now() -> str:
    """An RFC 3339 timestamp with seconds precision."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def exit_code(returncode: int) -> int:
    """A container's exit code as Kubernetes reports it: 128 + signal when killed by one."""
    return 128 - returncode if returncode < 0 else returncode


def terminated(returncode: int, started: str) -> dict[str, Any]:
    """A `terminated` container state for a process that exited with `returncode`."""
    code = exit_code(returncode)
    state: dict[str, Any] = {
        "exitCode": code,
        "reason": "Completed" if code == 0 else "Error",
        "startedAt": started,
        "finishedAt": now(),
    }
    if returncode < 0:
        state["signal"] = -returncode
        state["message"] = f"killed by {signal.Signals(-returncode).name}"
    return state


@dataclasses.dataclass
class ContainerState:
    """What the kubelet knows about the pod's one container."""

    name: str
    image: str
    restart_count: int = 0
    state: dict[str, Any] = dataclasses.field(
        default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}}
    )
    last_state: dict[str, Any] = dataclasses.field(default_factory=dict)
    ready: bool = False

    def document(self) -> dict[str, Any]:
        """The `containerStatuses[0]` entry."""
        return {
            "name": self.name,
            "image": self.image,
            "imageID": f"local://{self.image}",
            "ready": self.ready,
            "started": "running" in self.state,
            "restartCount": self.restart_count,
            "state": self.state,
            "lastState": self.last_state,
        }


def pod_status(
    phase: str,
    container: ContainerState,
    pod_ip: str | None,
    host_ip: str,
    start_time: str,
    initialized: bool = True,
) -> dict[str, Any]:
    """The whole `status` of a scheduled pod."""
    ready = "True" if container.ready else "False"
    conditions = [
        {"type": "PodScheduled", "status": "True"},
        {"type": "Initialized", "status": "True" if initialized else "False"},
        {"type": "ContainersReady", "status": ready},
        {"type": "Ready", "status": ready},
    ]
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": conditions,
        "hostIP": host_ip,
        "startTime": start_time,
        "containerStatuses": [container.document()],
    }
    if pod_ip:
        status["podIP"] = pod_ip
        status["podIPs"] = [{"ip": pod_ip}]
    return status


def unschedulable(message: str) -> dict[str, Any]:
    """The status the scheduler writes for a pod no node can take."""
    return {
        "phase": "Pending",
        "conditions": [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": message,
                "lastTransitionTime": now(),
            }
        ],
    }
