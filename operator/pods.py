"""Reading a rank pod: readiness, termination, age, and what is wrong with it.

Pure helpers over pod dicts as the API server returns them, shared by `reconcile.py` (which
pods to replace) and `status.py` (what to tell the user). `diagnose` is the one place that turns
pod conditions and container states into a rank stage and a human message.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping
from typing import Any

from corefleet.operator.naming import HASH_ANNOTATION, RANK_LABEL

CRASH_LOOP_WINDOW_SECONDS = 300  # restarts this recent count as crash-looping even when Ready
CRASH_LOOP_RESTARTS = 2
IMAGE_PULL_REASONS = {"ImagePullBackOff", "ErrImagePull", "InvalidImageName"}
CONFIG_REASONS = {"CreateContainerConfigError", "CreateContainerError", "RunContainerError"}
MAX_MESSAGE_CHARS = 300  # of a rank's termination message, in the status

Pod = Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    """What a rank pod is doing: a stage, a message for humans, a CamelCase reason."""

    stage: str  # Pending | Scheduling | Loading | Handshaking | Ready | Draining | Failed
    message: str
    reason: str


def parse_time(value: Any) -> datetime.datetime | None:
    """An RFC 3339 timestamp from the API (None when absent or unreadable)."""
    if not isinstance(value, str):
        return None
    try:
        parsed = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=datetime.timezone.utc)


def format_time(value: datetime.datetime) -> str:
    """An RFC 3339 timestamp with seconds precision, as Kubernetes writes them."""
    return value.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def rank_of(pod: Pod) -> int | None:
    """The rank from the pod's label, or None for a pod that is not a rank."""
    value = (pod.get("metadata", {}).get("labels") or {}).get(RANK_LABEL)
    return int(value) if isinstance(value, str) and value.isdigit() else None


def pod_hash(pod: Pod) -> str | None:
    """The spec hash the pod was created with."""
    return (pod.get("metadata", {}).get("annotations") or {}).get(HASH_ANNOTATION)


def is_terminating(pod: Pod) -> bool:
    """The pod was deleted and is shutting down (draining, for an engine)."""
    return bool(pod.get("metadata", {}).get("deletionTimestamp"))


def is_finished(pod: Pod) -> bool:
    """The pod will never run again (phase Failed or Succeeded: evicted, node lost, ...)."""
    return (pod.get("status") or {}).get("phase") in ("Failed", "Succeeded")


def _condition(pod: Pod, kind: str) -> Mapping[str, Any]:
    for cond in (pod.get("status") or {}).get("conditions") or ():
        if cond.get("type") == kind:
            return dict(cond)
    return {}


def is_ready(pod: Pod) -> bool:
    """The pod's Ready condition is True and it is not being deleted."""
    return _condition(pod, "Ready").get("status") == "True" and not is_terminating(pod)


def age_seconds(pod: Pod, now: datetime.datetime) -> float:
    """Seconds since the pod was created (0 when the server gave no timestamp)."""
    created = parse_time(pod.get("metadata", {}).get("creationTimestamp"))
    return (now - created).total_seconds() if created else 0.0


def _container(pod: Pod) -> Mapping[str, Any]:
    statuses = (pod.get("status") or {}).get("containerStatuses") or ()
    return statuses[0] if statuses else {}


def _last_exit(container: Mapping[str, Any]) -> str:
    last = (container.get("lastState") or {}).get("terminated") or {}
    if not last:
        return ""
    said = _termination_message(container)
    exit_text = f"last exit {last.get('reason', 'Error')} (code {last.get('exitCode', '?')})"
    return f"{exit_text}: {said}" if said else exit_text


def _termination_message(container: Mapping[str, Any]) -> str:
    """What the rank wrote on its way out (why it could not start), first line, bounded."""
    last = (container.get("lastState") or {}).get("terminated") or {}
    message = str(last.get("message") or "").strip()
    return message.splitlines()[0][:MAX_MESSAGE_CHARS] if message else ""


def _crash_looping(container: Mapping[str, Any], now: datetime.datetime) -> bool:
    if int(container.get("restartCount") or 0) < CRASH_LOOP_RESTARTS:
        return False
    finished = parse_time(
        ((container.get("lastState") or {}).get("terminated") or {}).get("finishedAt")
    )
    return finished is not None and (now - finished).total_seconds() < CRASH_LOOP_WINDOW_SECONDS


def _unschedulable(message: str) -> str:
    lowered = message.lower()
    if "nvidia.com/gpu" in lowered:
        return "InsufficientGPU"
    if "persistentvolumeclaim" in lowered and "not found" in lowered:
        return "ModelVolumeNotFound"
    return "Unschedulable"


def _waiting_failure(container: Mapping[str, Any], image: str) -> Diagnosis | None:
    waiting = (container.get("state") or {}).get("waiting") or {}
    reason, detail = waiting.get("reason", ""), waiting.get("message", "")
    restarts = int(container.get("restartCount") or 0)
    if reason in IMAGE_PULL_REASONS:
        return Diagnosis("Failed", f"cannot pull image {image}: {detail or reason}", reason)
    if reason == "CrashLoopBackOff":
        last = _last_exit(container)
        why = "OOMKilled" if "OOMKilled" in last else "CrashLoopBackOff"
        if "invalid engine argument" in _termination_message(container):
            why = "InvalidEngineArgument"  # the spec must change: restarts cannot help
        return Diagnosis(
            "Failed", f"crash-looping after {restarts} restarts; {last}".rstrip("; "), why
        )
    if reason in CONFIG_REASONS:
        return Diagnosis("Failed", f"{reason}: {detail}".rstrip(": "), reason)
    return None


def diagnose(pod: Pod, now: datetime.datetime, joined: str | None = None) -> Diagnosis:
    """Stage and message of a rank pod.

    Args:
        pod: the pod as the API returns it.
        now: the current time (crash-loop recency).
        joined: what the coordinator says about this rank ("handshaking", "loading", "ready",
            "draining", or "absent" when it answered without the rank); None when unknown.
    """
    status = pod.get("status") or {}
    container = _container(pod)
    containers = (pod.get("spec") or {}).get("containers") or [{}]
    image = str(containers[0].get("image", ""))
    if is_terminating(pod):
        return Diagnosis("Draining", "shutting down (SIGTERM sent)", "Draining")
    if is_finished(pod):
        why = status.get("reason") or "PodFailed"
        return Diagnosis(
            "Failed", f"pod {status.get('phase')}: {status.get('message') or why}", why
        )
    failure = _waiting_failure(container, image)
    if failure is not None:
        return failure
    if _crash_looping(container, now):
        last = _last_exit(container)
        why = "OOMKilled" if "OOMKilled" in last else "CrashLoopBackOff"
        return Diagnosis("Failed", f"restarted {container.get('restartCount')} times; {last}", why)
    scheduled = _condition(pod, "PodScheduled")
    if scheduled.get("status") == "False":
        message = scheduled.get("message") or "waiting for a node"
        return Diagnosis("Scheduling", message, _unschedulable(message))
    if is_ready(pod):
        if joined == "draining":
            return Diagnosis("Draining", "draining: takes no new requests", "Draining")
        return Diagnosis("Ready", "serving", "Ready")
    last = _last_exit(container)
    if last and "running" in (container.get("state") or {}):
        # It served (or tried to) and its process died: the kubelet restarted it in place.
        # Reported apart from a first start so the status can say the fleet is degraded.
        return Diagnosis("Loading", f"restarted after {last}; loading again", "Restarted")
    if status.get("phase") == "Running" and "running" in (container.get("state") or {}):
        if joined in (None, "loading"):
            return Diagnosis("Loading", "loading the model and warming up", "Loading")
        if joined == "absent":
            return Diagnosis("Handshaking", "not yet joined the coordinator", "Handshaking")
        return Diagnosis("Handshaking", f"coordinator reports {joined}", "Handshaking")
    waiting = (container.get("state") or {}).get("waiting") or {}
    return Diagnosis("Pending", waiting.get("reason") or "waiting for the kubelet", "Pending")
