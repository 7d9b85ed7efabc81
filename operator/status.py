"""The InferenceEngine status: rank stages, counts, and the Ready/Progressing/Degraded conditions.

Called by `controller.reconcile_engine` after each reconcile, with the same observations the plan
was made from. Pure: the previous status goes in (to keep `lastTransitionTime` and the failed-rank
counters), the new status comes out; the caller writes it through the `/status` subresource only
when it differs. Conditions follow the API conventions: every type is set from the first visit,
reasons are one CamelCase word, messages are for people, there is no phase.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from corefleet.operator import pods as podlib
from corefleet.operator.events import GROUP_RESTARTING, NO_POD
from corefleet.operator.naming import Owner, endpoint, engine_pod_name, rank_selector
from corefleet.operator.reconcile import Observed, Plan
from corefleet.operator.spec import EngineSpec

CONDITION_TYPES = ("Ready", "Progressing", "Degraded")


@dataclasses.dataclass(frozen=True)
class Condition:
    """One condition before timestamps are attached."""

    type: str
    status: str  # True | False | Unknown
    reason: str
    message: str


@dataclasses.dataclass(frozen=True)
class Context:
    """Observations beyond the children themselves.

    Attributes:
        generation: metadata.generation of the InferenceEngine.
        coordinator_ready: the coordinator Deployment has an available pod.
        coordinators: "ready/desired" coordinator pods; None before the Deployment is seen.
        volume_missing: the model's PersistentVolumeClaim does not exist.
        joined: rank -> state reported by the coordinator's /admin/engines; None if unreachable.
    """

    generation: int
    coordinator_ready: bool
    coordinators: str | None = None
    volume_missing: bool = False
    joined: Mapping[int, str] | None = None


def _rank_entries(
    owner: Owner,
    spec: EngineSpec,
    observed: Observed,
    plan: Plan,
    ctx: Context,
    now: datetime.datetime,
) -> list[dict[str, Any]]:
    entries = []
    for rank in sorted(set(range(spec.data_parallel_size)) | set(observed.pods)):
        pod = observed.pods.get(rank)
        entry: dict[str, Any] = {"rank": rank, "pod": engine_pod_name(owner.name, rank)}
        if pod is None:
            entry.update(stage="Pending", message=NO_POD, reason="Pending")
        else:
            joined = None if ctx.joined is None else ctx.joined.get(rank, "absent")
            diag = podlib.diagnose(pod, now, joined)
            entry.update(stage=diag.stage, message=diag.message, reason=diag.reason)
            statuses = (pod.get("status") or {}).get("containerStatuses") or [{}]
            entry["restarts"] = int(statuses[0].get("restartCount") or 0)
            entry["updated"] = podlib.pod_hash(pod) == plan.desired_hash
        if plan.replacements.get(rank):
            entry["replacements"] = plan.replacements[rank]
        entries.append(entry)
    return entries


def _degraded(ranks: Sequence[Mapping[str, Any]], plan: Plan, ctx: Context) -> Condition:
    if ctx.volume_missing:
        return Condition(
            "Degraded",
            "True",
            "ModelVolumeNotFound",
            "the model's PersistentVolumeClaim does not exist",
        )
    for entry in ranks:
        if entry["stage"] == "Failed" or entry["reason"] == "ModelVolumeNotFound":
            return Condition(
                "Degraded", "True", entry["reason"], f"rank {entry['rank']}: {entry['message']}"
            )
    for entry in ranks:
        if entry["reason"] == "Restarted":  # a rank lost its process and is reloading
            return Condition(
                "Degraded", "True", "RankRestarted", f"rank {entry['rank']}: {entry['message']}"
            )
    if plan.deadline_exceeded:
        return Condition(
            "Degraded",
            "True",
            "ProgressDeadlineExceeded",
            f"ranks {list(plan.deadline_exceeded)} not Ready within the deadline",
        )
    return Condition("Degraded", "False", "AllRanksHealthy", "no rank is failing")


def _progressing(
    spec: EngineSpec, ranks: Sequence[Mapping[str, Any]], plan: Plan, rolling: bool
) -> Condition:
    """`rolling`: the previous status said RollingUpdate; it goes on until the new ranks serve."""
    size = spec.data_parallel_size
    if plan.deadline_exceeded:
        return Condition(
            "Progressing",
            "False",
            "ProgressDeadlineExceeded",
            f"ranks {list(plan.deadline_exceeded)} did not become Ready within "
            f"{spec.progress_deadline_seconds}s",
        )
    if any(e["rank"] >= size for e in ranks):
        return Condition("Progressing", "True", "ScalingDown", f"draining ranks >= {size}")
    if any(e.get("updated") is False for e in ranks):
        outdated = [e["rank"] for e in ranks if e.get("updated") is False]
        return Condition(
            "Progressing", "True", "RollingUpdate", f"ranks {outdated} still run an older spec"
        )
    if any(e["reason"] == "InsufficientGPU" for e in ranks):
        return Condition(
            "Progressing", "True", "WaitingForCapacity", "ranks wait for nodes with free GPUs"
        )
    pending = [e["rank"] for e in ranks if e["stage"] not in ("Ready", "Failed")]
    if pending and rolling:
        return Condition(
            "Progressing",
            "True",
            "RollingUpdate",
            f"ranks {pending} of the current spec are starting",
        )
    if pending:
        return Condition("Progressing", "True", "RanksStarting", f"ranks {pending} are starting")
    return Condition("Progressing", "False", "Complete", "all ranks run the current spec")


def _group_restarting(
    spec: EngineSpec,
    ranks: Sequence[Mapping[str, Any]],
    ready: int,
    previous: Mapping[str, Any],
) -> Condition | None:
    """Ready=False/ExpertParallelGroupRestarting while an expert-parallel group is not whole.

    One rank lost (its process died, its pod was evicted or vanished) stops the whole group:
    the others fail their next collective, exit and are restarted by the kubelet, and the group
    re-forms once every rank is back at the rendezvous. It starts with a rank of the current
    spec that is not Ready after having been Ready (in the previous status) or that restarted
    in place, and lasts, through the previous status's reason, until every rank is Ready. A
    rolling update (some rank of an older spec) restarts the group on purpose: Progressing says
    RollingUpdate then, and Ready keeps its ordinary reasons.
    """
    size = spec.data_parallel_size
    if not spec.enable_expert_parallel or size < 2 or ready >= size:
        return None
    if any(e.get("updated") is False for e in ranks):
        return None
    was_ready = {e.get("rank") for e in previous.get("ranks") or () if e.get("stage") == "Ready"}
    down = [e for e in ranks if e["rank"] < size and e["stage"] != "Ready"]
    lost = [e for e in down if e["reason"] == "Restarted" or e["rank"] in was_ready]
    if not lost and _reason(previous, "Ready") != GROUP_RESTARTING:
        return None  # a group that is still forming for the first time
    return Condition(
        "Ready",
        "False",
        GROUP_RESTARTING,
        f"ranks {[e['rank'] for e in down]} of the expert-parallel group are not ready "
        f"({ready}/{size} ready): the group's {size} ranks restart together, and the "
        "coordinator migrates their streams once the group is back",
    )


def _ready(
    spec: EngineSpec,
    ranks: Sequence[Mapping[str, Any]],
    ready: int,
    ctx: Context,
    previous: Mapping[str, Any],
) -> Condition:
    size = spec.data_parallel_size
    failed = [e["rank"] for e in ranks if e["stage"] == "Failed"]
    if failed:  # never Ready while a rank crash-loops, even if the others serve
        return Condition("Ready", "False", "RankFailed", f"ranks {failed} failed")
    if size == 0:
        return Condition("Ready", "False", "ScaledToZero", "dataParallelSize is 0")
    # Before the coordinator's reason: with the whole group down no rank is ready, so the
    # coordinators turn unready too, which is the effect, not the cause.
    group = _group_restarting(spec, ranks, ready, previous)
    if group is not None:
        return group
    if not ctx.coordinator_ready:
        return Condition(
            "Ready", "False", "CoordinatorUnavailable", "no coordinator pod is available"
        )
    if ready < size:
        return Condition("Ready", "False", "RanksNotReady", f"{ready}/{size} ranks ready")
    return Condition("Ready", "True", "AllRanksReady", f"{ready}/{size} ranks ready")


def _reason(status: Mapping[str, Any], kind: str) -> str | None:
    found = [c for c in status.get("conditions") or [] if c.get("type") == kind]
    return found[0].get("reason") if found else None


def conditions_with_times(
    new: Sequence[Condition],
    previous: Sequence[Mapping[str, Any]],
    generation: int,
    now: datetime.datetime,
) -> list[dict[str, Any]]:
    """Attach `lastTransitionTime` (kept while the status value stays) and observedGeneration."""
    old = {c.get("type"): c for c in previous}
    out = []
    for cond in new:
        before = old.get(cond.type) or {}
        since = before.get("lastTransitionTime") if before.get("status") == cond.status else None
        out.append(
            {
                "type": cond.type,
                "status": cond.status,
                "reason": cond.reason,
                "message": cond.message,
                "observedGeneration": generation,
                "lastTransitionTime": since or podlib.format_time(now),
            }
        )
    return out


def compute_status(
    owner: Owner,
    spec: EngineSpec,
    observed: Observed,
    plan: Plan,
    ctx: Context,
    previous: Mapping[str, Any],
    now: datetime.datetime,
) -> dict[str, Any]:
    """The whole `.status` for one engine."""
    size = spec.data_parallel_size
    ranks = _rank_entries(owner, spec, observed, plan, ctx, now)
    live = [p for p in observed.pods.values() if not podlib.is_terminating(p)]
    ready = sum(1 for r, p in observed.pods.items() if r < size and podlib.is_ready(p))
    updated = sum(
        1
        for r, p in observed.pods.items()
        if r < size and not podlib.is_terminating(p) and podlib.pod_hash(p) == plan.desired_hash
    )
    conditions = [
        _ready(spec, ranks, ready, ctx, previous),
        _progressing(spec, ranks, plan, _reason(previous, "Progressing") == "RollingUpdate"),
        _degraded(ranks, plan, ctx),
    ]
    for entry in ranks:
        entry.pop("reason")
    status = {
        "observedGeneration": ctx.generation,
        "replicas": len(live),
        "readyReplicas": ready,
        "updatedReplicas": updated,
        "rankSummary": f"{ready}/{size}",
        "selector": rank_selector(owner.name),
        "endpoint": endpoint(owner, spec),
        "coordinatorReady": ctx.coordinator_ready,
        "ranks": ranks,
        "conditions": conditions_with_times(
            conditions, previous.get("conditions") or [], ctx.generation, now
        ),
    }
    if ctx.coordinators is not None:
        status["coordinatorSummary"] = ctx.coordinators
    return status


def invalid_spec_status(
    previous: Mapping[str, Any], generation: int, message: str, now: datetime.datetime
) -> dict[str, Any]:
    """Status for a spec the operator cannot act on: reported once, never retried."""
    conditions = [
        Condition(kind, status, "InvalidSpec", message)
        for kind, status in (("Ready", "False"), ("Progressing", "False"), ("Degraded", "True"))
    ]
    return {
        **dict(previous),
        "observedGeneration": generation,
        "conditions": conditions_with_times(
            conditions, previous.get("conditions") or [], generation, now
        ),
    }
