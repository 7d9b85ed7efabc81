"""The Kubernetes Events posted on an InferenceEngine for what changed between two statuses.

`controller.reconcile_engine` writes a status after every reconcile and then posts, through
`kopf.event`, what `transition_events(previous, new)` returns, so `kubectl describe ie NAME`
lists every transition once: an Event per change, never one per reconcile (an unchanged status
gives none). The previous status is the one the operator last wrote, or the stored one after a
restart, so a restarted operator repeats nothing.

The actions themselves post their own Events (`controller.RANK_EVENTS`): `RankCreated`,
`RankScaledDown`, `RankReplaced` (rolling update) and `RankFailedReplaced`. Here, from the status:

| reason | type | when |
|---|---|---|
| `RankJoined` | Normal | a rank became Ready |
| `RankDraining` | Normal | a rank started draining (scale-down, replacement, deletion) |
| `RankRemoved` | Normal | a rank left the status: its pod is gone after a scale-down |
| `RankFailed` | Warning | a rank failed (crash loop, image pull, pod Failed, ...) |
| `RankNotReady` | Warning | a Ready rank is not Ready any more (e.g. restarted, loading again) |
| `RankLost` | Warning | a Ready rank's pod vanished without draining (force-deleted, node gone) |
| `RankUnschedulable` | Warning | a rank's pod waits for a node (e.g. no free GPU) |
| `CoordinatorReady` | Normal | the coordinator Deployment has an available pod again |
| `CoordinatorUnavailable` | Warning | the coordinator Deployment lost its available pod |
| `RolloutStarted` | Normal | ranks run an older spec: the rolling update begins |
| `RolloutComplete` | Normal | the rolling update finished: every rank runs the current spec |
| `ExpertParallelGroupRestarting` | Warning | an expert-parallel group lost a rank: all restart |
| `ExpertParallelGroupReady` | Normal | that group is whole again: every rank is Ready |
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

NO_POD = "pod not created yet"  # status.py's message for a rank without a pod
# status.py's Ready reason while an expert-parallel group restarts after losing a rank.
GROUP_RESTARTING = "ExpertParallelGroupRestarting"


@dataclasses.dataclass(frozen=True)
class EngineEvent:
    """A Kubernetes Event to post on the InferenceEngine."""

    type: str  # Normal | Warning
    reason: str
    message: str


def _stage_event(
    rank: int, before: Mapping[str, Any], entry: Mapping[str, Any]
) -> EngineEvent | None:
    """The Event of one rank whose stage changed (`before` is {} for a new rank)."""
    stage, was = entry["stage"], before.get("stage")
    message = entry.get("message") or ""
    if stage == "Ready":
        return EngineEvent("Normal", "RankJoined", f"rank {rank} is ready")
    if stage == "Draining":
        return EngineEvent("Normal", "RankDraining", f"rank {rank} is draining")
    if stage == "Failed":
        return EngineEvent("Warning", "RankFailed", f"rank {rank}: {message}")
    if stage == "Scheduling":
        return EngineEvent("Warning", "RankUnschedulable", f"rank {rank}: {message}")
    if was != "Ready":
        return None  # the ordinary way up: Pending -> Loading -> Handshaking -> Ready
    if message == NO_POD:
        if before.get("updated") is False:
            return None  # the rolling update replaced it (RankReplaced says so)
        pod = before.get("pod") or entry.get("pod")
        return EngineEvent(
            "Warning", "RankLost", f"rank {rank}: pod {pod} is gone without draining; recreating it"
        )
    return EngineEvent("Warning", "RankNotReady", f"rank {rank} is not ready: {message}")


def rank_events(
    previous: Sequence[Mapping[str, Any]], current: Sequence[Mapping[str, Any]]
) -> list[EngineEvent]:
    """Events for the ranks whose stage changed, in rank order, then for ranks that left."""
    before = {e.get("rank"): e for e in previous}
    events = []
    for entry in current:
        rank = entry["rank"]
        old = before.get(rank) or {}
        if old.get("stage") == entry["stage"]:
            continue
        event = _stage_event(rank, old, entry)
        if event is not None:
            events.append(event)
    now = {e["rank"] for e in current}
    for rank, old in sorted((r, e) for r, e in before.items() if r not in now):
        events.append(
            EngineEvent("Normal", "RankRemoved", f"rank {rank} removed ({old.get('pod')} is gone)")
        )
    return events


def _condition(status: Mapping[str, Any], kind: str) -> Mapping[str, Any]:
    return next((c for c in status.get("conditions") or [] if c.get("type") == kind), {})


def _rollout_events(previous: Mapping[str, Any], current: Mapping[str, Any]) -> list[EngineEvent]:
    was = _condition(previous, "Progressing").get("reason")
    now = _condition(current, "Progressing")
    if now.get("reason") == "RollingUpdate" and was != "RollingUpdate":
        return [EngineEvent("Normal", "RolloutStarted", str(now.get("message") or ""))]
    if was == "RollingUpdate" and now.get("reason") == "Complete":
        ranks = current.get("updatedReplicas")
        message = f"every rank runs the current spec ({ranks} updated)"
        return [EngineEvent("Normal", "RolloutComplete", message)]
    return []


def _coordinator_events(
    previous: Mapping[str, Any], current: Mapping[str, Any]
) -> list[EngineEvent]:
    was, now = previous.get("coordinatorReady"), current.get("coordinatorReady")
    if was is None or now is None or was == now:
        return []  # unknown before (a new engine, an older operator's status): no transition
    if now:
        return [EngineEvent("Normal", "CoordinatorReady", "the coordinator has an available pod")]
    return [
        EngineEvent("Warning", "CoordinatorUnavailable", "the coordinator has no available pod")
    ]


def _group_events(previous: Mapping[str, Any], current: Mapping[str, Any]) -> list[EngineEvent]:
    was = _condition(previous, "Ready").get("reason")
    now = _condition(current, "Ready")
    if now.get("reason") == GROUP_RESTARTING and was != GROUP_RESTARTING:
        return [EngineEvent("Warning", GROUP_RESTARTING, str(now.get("message") or ""))]
    if was == GROUP_RESTARTING and now.get("reason") != GROUP_RESTARTING:
        ready, summary = current.get("readyReplicas"), current.get("rankSummary", "")
        if summary == f"{ready}/{ready}":  # whole again (not left for another failure)
            message = f"the expert-parallel group is whole again ({summary} ranks ready)"
            return [EngineEvent("Normal", "ExpertParallelGroupReady", message)]
    return []


def transition_events(previous: Mapping[str, Any], current: Mapping[str, Any]) -> list[EngineEvent]:
    """Every Event for the change from the `previous` status to the `current` one."""
    return [
        *_coordinator_events(previous, current),
        *rank_events(previous.get("ranks") or [], current.get("ranks") or []),
        *_rollout_events(previous, current),
        *_group_events(previous, current),
    ]
