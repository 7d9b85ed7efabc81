"""Built-in kinds' server-side printing columns, as kube-apiserver's printers define them.

- Pods: NAME READY STATUS RESTARTS AGE (+ IP, NODE, NOMINATED NODE, READINESS GATES with
  `-o wide`), STATUS derived from the status fields the way the pod printer does (`Pending`,
  `ContainerCreating`, `Running`, `CrashLoopBackOff`, `Completed`, `Error`, `Init:0/1`,
  `Terminating`, ...), RESTARTS with the last restart's age ("3 (5s ago)");
- Deployments: NAME READY UP-TO-DATE AVAILABLE AGE (+ CONTAINERS, IMAGES, SELECTOR);
- Services: NAME TYPE CLUSTER-IP EXTERNAL-IP PORT(S) AGE (+ SELECTOR);
- Namespaces: NAME STATUS AGE; Events: LAST SEEN TYPE REASON OBJECT MESSAGE;
- every other built-in: NAME AGE. Custom resources: `kubeemu_table.custom_printer`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from kubeemu_table import (
    AGE,
    NAME,
    Obj,
    Printer,
    age,
    column,
    custom_printer,
    human_duration,
    meta,
    name_age,
    parse_time,
)


def _restart_text(restarts: int, last: float | None) -> str:
    return f"{restarts} ({human_duration(time.time() - last)} ago)" if last else str(restarts)


def _container_reason(status: Obj) -> str | None:
    """The STATUS a container's state gives the pod, or None while it runs."""
    state = status.get("state") or {}
    waiting, terminated = state.get("waiting") or {}, state.get("terminated")
    if waiting.get("reason"):
        return str(waiting["reason"])
    if terminated is not None:
        if terminated.get("reason"):
            return str(terminated["reason"])
        if terminated.get("signal"):
            return f"Signal:{terminated['signal']}"
        return f"ExitCode:{terminated.get('exitCode', 0)}"
    return None


def pod_summary(pod: Obj) -> tuple[str, str, str]:
    """READY, STATUS and RESTARTS of a pod, derived as kube-apiserver's pod printer does."""
    spec, status = pod.get("spec") or {}, pod.get("status") or {}
    phase = status.get("phase") or "Pending"
    reason = status.get("reason") or phase
    ready, restarts, last_restart = 0, 0, None
    total = len(spec.get("containers") or [])
    init_specs = spec.get("initContainers") or []

    def count(cs: Obj) -> None:
        nonlocal restarts, last_restart
        restarts += int(cs.get("restartCount") or 0)
        finished = parse_time(
            ((cs.get("lastState") or {}).get("terminated") or {}).get("finishedAt")
        )
        if finished and (last_restart is None or finished > last_restart):
            last_restart = finished

    initializing = False
    for i, cs in enumerate(status.get("initContainerStatuses") or []):
        count(cs)
        state = cs.get("state") or {}
        terminated, waiting = state.get("terminated"), state.get("waiting") or {}
        if terminated is not None and terminated.get("exitCode", 0) == 0:
            continue
        if terminated is not None:
            reason = "Init:" + (_container_reason(cs) or "Error")
        elif waiting.get("reason") and waiting["reason"] != "PodInitializing":
            reason = "Init:" + waiting["reason"]
        else:
            reason = f"Init:{i}/{len(init_specs)}"
        initializing = True
        break
    if not initializing:
        restarts, last_restart, running = 0, None, False
        for cs in reversed(status.get("containerStatuses") or []):
            count(cs)
            why = _container_reason(cs)
            if why is not None:
                reason = why
            elif cs.get("ready") and (cs.get("state") or {}).get("running") is not None:
                running, ready = True, ready + 1
        if reason == "Completed" and running:
            pod_ready = any(
                c.get("type") == "Ready" and c.get("status") == "True"
                for c in status.get("conditions") or []
            )
            reason = "Running" if pod_ready else "NotReady"
    if meta(pod).get("deletionTimestamp") and phase not in ("Succeeded", "Failed"):
        reason = "Unknown" if status.get("reason") == "NodeLost" else "Terminating"
    return f"{ready}/{total}", reason, _restart_text(restarts, last_restart)


def _pod_cells(pod: Obj) -> list[Any]:
    ready, reason, restarts = pod_summary(pod)
    spec, status = pod.get("spec") or {}, pod.get("status") or {}
    gates = spec.get("readinessGates") or []
    true_conditions = {
        c.get("type") for c in status.get("conditions") or [] if c.get("status") == "True"
    }
    gates_text = (
        f"{sum(g.get('conditionType') in true_conditions for g in gates)}/{len(gates)}"
        if gates
        else "<none>"
    )
    return [
        meta(pod).get("name"),
        ready,
        reason,
        restarts,
        age(meta(pod).get("creationTimestamp")),
        status.get("podIP") or "<none>",
        spec.get("nodeName") or "<none>",
        status.get("nominatedNodeName") or "<none>",
        gates_text,
    ]


def _selector_text(labels: Mapping[str, Any] | None) -> str:
    return ",".join(f"{k}={v}" for k, v in (labels or {}).items()) or "<none>"


def _deployment_cells(dep: Obj) -> list[Any]:
    spec, status = dep.get("spec") or {}, dep.get("status") or {}
    containers = ((spec.get("template") or {}).get("spec") or {}).get("containers") or []
    desired = spec.get("replicas", 1)
    return [
        meta(dep).get("name"),
        f"{status.get('readyReplicas') or 0}/{desired}",
        int(status.get("updatedReplicas") or 0),
        int(status.get("availableReplicas") or 0),
        age(meta(dep).get("creationTimestamp")),
        ",".join(c.get("name", "") for c in containers),
        ",".join(c.get("image", "") for c in containers),
        _selector_text((spec.get("selector") or {}).get("matchLabels")),
    ]


def _port_text(port: Obj) -> str:
    node_port = f":{port['nodePort']}" if port.get("nodePort") else ""
    return f"{port.get('port')}{node_port}/{port.get('protocol', 'TCP')}"


def _service_cells(svc: Obj) -> list[Any]:
    spec = svc.get("spec") or {}
    external = spec.get("externalIPs") or []
    return [
        meta(svc).get("name"),
        spec.get("type") or "ClusterIP",
        spec.get("clusterIP") or "<none>",
        ",".join(external) or "<none>",
        ",".join(_port_text(p) for p in spec.get("ports") or []) or "<none>",
        age(meta(svc).get("creationTimestamp")),
        _selector_text(spec.get("selector")),
    ]


def _event_cells(event: Obj) -> list[Any]:
    involved = event.get("involvedObject") or {}
    series = (event.get("series") or {}).get("lastObservedTime")
    last = series or event.get("lastTimestamp") or event.get("eventTime")
    return [
        age(last),
        event.get("type") or "",
        event.get("reason") or "",
        f"{str(involved.get('kind', '')).lower()}/{involved.get('name', '')}",
        str(event.get("message") or "").strip(),
        age(event.get("firstTimestamp") or event.get("eventTime")),
        int(event.get("count") or 1),
        meta(event).get("name"),
    ]


BUILTIN_PRINTERS: dict[str, Printer] = {
    "v1/pods": Printer(
        [
            NAME,
            column("Ready", "The aggregate readiness state of this pod for accepting traffic."),
            column("Status", "The aggregate status of the containers in this pod."),
            column("Restarts", "The number of times the containers in this pod have restarted."),
            AGE,
            column("IP", "IP address allocated to the pod.", priority=1),
            column("Node", "The node this pod is bound to.", priority=1),
            column("Nominated Node", "The node the scheduler nominated.", priority=1),
            column("Readiness Gates", "Readiness gates that are True / all.", priority=1),
        ],
        _pod_cells,
    ),
    "apps/v1/deployments": Printer(
        [
            NAME,
            column("Ready", "Number of the pod with ready state"),
            column("Up-to-date", "Total number of non-terminated pods updated", "integer"),
            column("Available", "Number of available pods", "integer"),
            AGE,
            column("Containers", "Names of each container in the template.", priority=1),
            column("Images", "Images referenced by each container in the template.", priority=1),
            column("Selector", "Label query over pods that should match the replicas", priority=1),
        ],
        _deployment_cells,
    ),
    "v1/services": Printer(
        [
            NAME,
            column("Type", "The type of the service."),
            column("Cluster-IP", "The cluster IP of the service."),
            column("External-IP", "The external IPs of the service."),
            column("Port(s)", "The ports of the service."),
            AGE,
            column("Selector", "Route traffic to pods with matching labels.", priority=1),
        ],
        _service_cells,
    ),
    "v1/events": Printer(
        [
            column("Last Seen", "Time since the event was last seen."),
            column("Type", "Normal or Warning."),
            column("Reason", "Why the event was reported."),
            column("Object", "The object the event is about."),
            column("Message", "What happened."),
            column("First Seen", "Time since the event was first seen.", priority=1),
            column("Count", "How often it happened.", "integer", priority=1),
            column("Name", "The event's name.", priority=1),
        ],
        _event_cells,
    ),
    "v1/namespaces": Printer(
        [NAME, column("Status", "The status of the namespace."), AGE],
        lambda ns: [
            meta(ns).get("name"),
            (ns.get("status") or {}).get("phase") or "Active",
            age(meta(ns).get("creationTimestamp")),
        ],
    ),
}


def printer_for(path: str, printer_columns: Sequence[Mapping[str, Any]] | None) -> Printer:
    """The printer of a resource path ("v1/pods"); `printer_columns` is set for CRD resources."""
    if printer_columns is not None:
        return custom_printer(printer_columns)
    return BUILTIN_PRINTERS.get(path, Printer([NAME, AGE], name_age))
