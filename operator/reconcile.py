"""The pure reconcile: (spec, observed children) -> the actions that move them toward the spec.

Called by `controller.reconcile_engine` on every trigger (create, update, resume, the timer, and
events of the engine's pods); it is level-based, so it looks only at what exists now and never at
what changed. It never talks to the API: the caller executes the returned actions in order and the
next call sees their effect.

Rules, in the order they are applied:

1. Children other than the rank pods are created when missing and patched when their spec hash
   differs from the one the builders produce now. The CURVE Secret is only ever created. A
   child of an optional kind (the coordinators' HPA) that the spec no longer asks for is
   deleted; every other child lives as long as the engine.
2. Scale down: ranks >= dataParallelSize are deleted, highest first. Their SIGTERM drains them;
   they are first annotated do-not-disrupt so no autoscaler kills the node under a drain.
3. A rank whose pod is finished (phase Failed/Succeeded: evicted, node lost) is deleted so it can be
   recreated; repeated failures of the same rank back off exponentially.
4. Missing ranks below dataParallelSize are created (pod names are fixed, so a rank whose old pod
   is still terminating waits for it to go).
5. Ranks carry autoscaler do-not-disrupt annotations exactly while they are not Ready (loading).
6. Rolling update: ranks created from an older spec are replaced one at a time, highest rank
   first, each only after every current-spec rank is Ready. A rank that is not Ready gates the
   rollout for at most progressDeadlineSeconds (the escape hatch: a crash-looping rank cannot
   deadlock a rollout). Outdated ranks that are not Ready anyway are replaced at once: they serve
   nothing, and a fixed spec must be able to replace a broken one.

An expert-parallel group (spec.enableExpertParallel) lives and dies whole: its ranks form one
torch.distributed group, and a rank whose peer is gone fails its next collective and exits (the
kubelet restarts it in place; the operator only recreates missing and finished pods, rules 3-4,
as for any fleet). So three rules differ for it:

4. While rank 0's pod of an older spec still runs or drains, no rank is created: a new rank
   would dial the old group's rank 0 (the DNS name is the same, and it still resolves while that
   pod drains) instead of waiting for the new one.
5. Its ranks are guarded from autoscalers also while Ready: moving one rank for cost would stop
   the whole group (node drains still may: see `resources.build_pod_disruption_budget`).
6. Every outdated rank is replaced at once: one rank of a new spec cannot join a group of the old
   one (its size is in every rank's flags, so a scale rolls the group too), and deleting them
   together sends SIGTERM to the whole group, which drains together.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping
from typing import Any

from corefleet.operator import pods as podlib
from corefleet.operator.curve import CurveKeys
from corefleet.operator.naming import (
    DO_NOT_DISRUPT,
    HASH_ANNOTATION,
    Owner,
    curve_secret_name,
    disruption_guard,
    engine_pod_name,
    spec_hash,
)
from corefleet.operator.resources import build_children, build_engine_pod, engine_pod_template
from corefleet.operator.spec import EngineSpec

# Child kinds that exist only while the spec asks for them (spec.coordinator.autoscaling).
OPTIONAL_KINDS = frozenset({"HorizontalPodAutoscaler"})


@dataclasses.dataclass(frozen=True)
class Action:
    """One API write. `body` is the manifest (create) or a JSON merge patch (patch)."""

    verb: str  # create | patch | delete
    kind: str  # Pod, or a child kind: Service, Deployment, HorizontalPodAutoscaler, ...
    name: str
    body: Mapping[str, Any] | None = None
    reason: str = ""  # CamelCase, also the Event reason for rank actions
    message: str = ""


@dataclasses.dataclass(frozen=True)
class Policy:
    """Timing knobs of the reconcile (the operator's, not the user's)."""

    failed_backoff_seconds: float = 10.0  # wait before replacing a rank that failed again
    failed_backoff_max_seconds: float = 300.0


@dataclasses.dataclass(frozen=True)
class Observed:
    """What exists now for one engine.

    Attributes:
        pods: rank -> pod body, for every pod labelled with this engine and a rank.
        children: (kind, name) -> spec-hash annotation, for every other child that exists.
        replacements: rank -> how often its failed pod was replaced in a row (from status).
    """

    pods: Mapping[int, Mapping[str, Any]]
    children: Mapping[tuple[str, str], str | None]
    replacements: Mapping[int, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The actions plus what the status needs to know about the rollout."""

    actions: tuple[Action, ...]
    replacements: dict[int, int]  # updated counts, to be stored in status
    desired_hash: str
    waiting_for: int | None  # the rank the rollout waits on, if it waits
    deadline_exceeded: tuple[int, ...]  # current-spec ranks not Ready within the deadline


def _child_patch(child: Mapping[str, Any]) -> dict[str, Any]:
    meta = child["metadata"]
    patch: dict[str, Any] = {
        "metadata": {
            "labels": meta["labels"],
            "annotations": {HASH_ANNOTATION: meta["annotations"][HASH_ANNOTATION]},
        }
    }
    for key in ("spec", "data"):
        if key in child:
            patch[key] = child[key]
    return patch


def _children_actions(
    owner: Owner, spec: EngineSpec, observed: Observed, keys: CurveKeys | None
) -> list[Action]:
    secret_missing = ("Secret", curve_secret_name(owner.name)) not in observed.children
    actions = []
    wanted = build_children(owner, spec, keys if secret_missing else None)
    for child in wanted:
        kind, name = child["kind"], child["metadata"]["name"]
        want = child["metadata"]["annotations"][HASH_ANNOTATION]
        if (kind, name) not in observed.children:
            actions.append(
                Action("create", kind, name, child, "ChildCreated", f"created {kind} {name}")
            )
        elif observed.children[(kind, name)] != want and kind != "Secret":
            actions.append(
                Action(
                    "patch",
                    kind,
                    name,
                    _child_patch(child),
                    "ChildUpdated",
                    f"updated {kind} {name} to the current spec",
                )
            )
    built = {(c["kind"], c["metadata"]["name"]) for c in wanted}
    for kind, name in sorted(observed.children):
        # The HPA of an engine whose autoscaling was removed: left in place, it would keep
        # resizing the Deployment against spec.coordinator.replicas.
        if kind in OPTIONAL_KINDS and (kind, name) not in built:
            actions.append(
                Action("delete", kind, name, None, "ChildDeleted", f"deleted {kind} {name}")
            )
    return actions


def _guard(name: str, on: bool, reason: str) -> Action:
    body = {"metadata": {"annotations": disruption_guard(on)}}
    return Action(
        "patch",
        "Pod",
        name,
        body,
        reason,
        "guarded from autoscaler disruption" if on else "released for autoscalers",
    )


def _backoff(policy: Policy, failures: int) -> float:
    if failures <= 0:
        return 0.0
    return min(
        policy.failed_backoff_seconds * 2 ** (failures - 1), policy.failed_backoff_max_seconds
    )


def plan(
    owner: Owner,
    spec: EngineSpec,
    observed: Observed,
    now: datetime.datetime,
    policy: Policy = Policy(),
    keys: CurveKeys | None = None,
) -> Plan:
    """Compute the actions for one engine: the module docstring's rules, in its order.

    Args:
        owner: the InferenceEngine's identity (children get owner references to it).
        spec: the parsed spec.
        observed: the children that exist now.
        now: the current time (ages, deadlines, back-off).
        policy: operator timing knobs.
        keys: fresh CURVE keys, used only if the Secret is missing (pure: no randomness here).
    """
    size = spec.data_parallel_size
    want = spec_hash(engine_pod_template(owner.name, spec))
    # A terminating pod already goes away: only rule 4 looks at it (its name is still taken).
    live = {r: p for r, p in observed.pods.items() if not podlib.is_terminating(p)}
    active = {r: p for r, p in live.items() if r < size and not podlib.is_finished(p)}
    actions = _children_actions(owner, spec, observed, keys)
    actions += _scale_down(owner.name, live, size)
    replaced, replacements = _replace_failed(
        owner.name, live, size, observed.replacements, now, policy
    )
    actions += replaced
    actions += _create_missing(owner, spec, observed.pods, want)
    actions += _guard_loading(owner.name, active, spec.enable_expert_parallel)
    rollout = _rolling_update(owner.name, spec, live, active, want, now)
    actions += rollout.actions
    return Plan(
        actions=tuple(actions),
        replacements=replacements,
        desired_hash=want,
        waiting_for=rollout.waiting_for,
        deadline_exceeded=rollout.deadline_exceeded,
    )


def _scale_down(engine: str, live: Mapping[int, podlib.Pod], size: int) -> list[Action]:
    """Rule 2: delete the ranks at or above ``size``, highest first, guarding each that runs."""
    actions = []
    for rank in sorted((r for r in live if r >= size), reverse=True):
        name = engine_pod_name(engine, rank)
        if not podlib.is_finished(live[rank]):
            actions.append(_guard(name, True, "DrainGuard"))
        actions.append(
            Action(
                "delete",
                "Pod",
                name,
                None,
                "RankScaledDown",
                f"rank {rank} removed by scale-down to {size}; it drains",
            )
        )
    return actions


def _replace_failed(
    engine: str,
    live: Mapping[int, podlib.Pod],
    size: int,
    counts: Mapping[int, int],
    now: datetime.datetime,
    policy: Policy,
) -> tuple[list[Action], dict[int, int]]:
    """Rule 3: delete the finished pods of ranks below ``size`` once their back-off has passed.

    ``counts`` are the replacements in a row per rank, from the status. Returns the actions and
    the new counts: one more for each rank replaced now, none for a rank that is Ready again
    (its streak is over) or at or above ``size``.
    """
    replacements = {r: c for r, c in counts.items() if r < size}
    actions = []
    for rank in sorted(r for r in live if r < size and podlib.is_finished(live[r])):
        failures = replacements.get(rank, 0)
        if podlib.age_seconds(live[rank], now) >= _backoff(policy, failures):
            replacements[rank] = failures + 1
            actions.append(
                Action(
                    "delete",
                    "Pod",
                    engine_pod_name(engine, rank),
                    None,
                    "RankFailedReplaced",
                    f"rank {rank} pod failed; replacing it (attempt {failures + 1})",
                )
            )
    for rank, pod in live.items():
        if rank < size and not podlib.is_finished(pod) and podlib.is_ready(pod):
            replacements.pop(rank, None)
    return actions, replacements


def _create_missing(
    owner: Owner, spec: EngineSpec, pods: Mapping[int, podlib.Pod], want: str
) -> list[Action]:
    """Rule 4: create the ranks below dataParallelSize that have no pod, terminating or not.

    For an expert-parallel group, none while rank 0's pod of another spec hash still runs or
    drains (a finished one never runs again): the new ranks would meet at it. Other old pods
    hold nobody back (only rank 0's name is dialled); each holds its own rank's name anyway.
    """
    old_zero = pods.get(0)
    if (
        spec.enable_expert_parallel
        and old_zero is not None
        and podlib.pod_hash(old_zero) != want
        and not podlib.is_finished(old_zero)
    ):
        return []
    return [
        Action(
            "create",
            "Pod",
            engine_pod_name(owner.name, rank),
            build_engine_pod(owner, spec, rank),
            "RankCreated",
            f"rank {rank} created",
        )
        for rank in range(spec.data_parallel_size)
        if rank not in pods
    ]


def _guard_loading(engine: str, active: Mapping[int, podlib.Pod], group: bool) -> list[Action]:
    """Rule 5: guard each active rank from autoscaler disruption exactly while it is not Ready;
    each rank of an expert-parallel ``group`` always."""
    actions = []
    for rank, pod in sorted(active.items()):
        ready = podlib.is_ready(pod)
        wanted = group or not ready
        guarded = (pod.get("metadata", {}).get("annotations") or {}).get(DO_NOT_DISRUPT) == "true"
        if wanted != guarded:
            name = engine_pod_name(engine, rank)
            reason = "RankReady" if guarded else "LoadGuard" if not ready else "GroupGuard"
            actions.append(_guard(name, wanted, reason))
    return actions


@dataclasses.dataclass(frozen=True)
class _Rollout:
    """What rule 6 decided: its deletions and what the status reports about the rollout."""

    actions: list[Action]
    waiting_for: int | None
    deadline_exceeded: tuple[int, ...]


def _rolling_update(
    engine: str,
    spec: EngineSpec,
    live: Mapping[int, podlib.Pod],
    active: Mapping[int, podlib.Pod],
    want: str,
    now: datetime.datetime,
) -> _Rollout:
    """Rule 6: replace the ranks of an older spec (pod hash other than ``want``).

    The highest outdated rank goes once no rank is missing and every current-spec rank is Ready
    or past its progress deadline; outdated ranks that are not Ready all go at once. Every
    outdated rank of an expert-parallel group goes at once.
    """
    current = {r: p for r, p in active.items() if podlib.pod_hash(p) == want}
    unready = [r for r, p in current.items() if not podlib.is_ready(p)]
    late = tuple(
        r for r in unready if podlib.age_seconds(current[r], now) >= spec.progress_deadline_seconds
    )
    missing = [r for r in range(spec.data_parallel_size) if r not in live]
    waiting = missing + [r for r in unready if r not in late]
    outdated = sorted((r for r in active if r not in current), reverse=True)
    broken = [r for r in outdated if not podlib.is_ready(active[r])]
    group = spec.enable_expert_parallel
    # A group's outdated ranks all go at once: it waits on nobody.
    replace = outdated if group else broken or (outdated[:1] if not waiting else [])
    why = "with its whole expert-parallel group " if group else ""
    actions = [
        Action(
            "delete",
            "Pod",
            engine_pod_name(engine, rank),
            None,
            "RankReplaced",
            f"rank {rank} replaced {why}by the rolling update",
        )
        for rank in replace
    ]
    gated = waiting and outdated and not broken and not group
    waiting_for = min(waiting) if gated else None
    return _Rollout(actions, waiting_for, late)
