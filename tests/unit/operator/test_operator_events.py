"""The Events posted for status transitions: one per change, none for an unchanged status."""

from __future__ import annotations

import itertools
from typing import Any

from corefleet.operator.events import NO_POD, rank_events, transition_events


def rank(number: int, stage: str, message: str = "", **extra: Any) -> dict[str, Any]:
    """A status.ranks entry."""
    return {
        "rank": number,
        "pod": f"llama-engine-{number}",
        "stage": stage,
        "message": message,
        **extra,
    }


def reasons(previous: dict[str, Any], current: dict[str, Any]) -> list[tuple[str, str]]:
    """(type, reason) of every Event for the change."""
    return [(e.type, e.reason) for e in transition_events(previous, current)]


def test_rank_events_on_stage_changes_only() -> None:
    before = [rank(0, "Loading"), rank(1, "Ready")]
    after = [
        rank(0, "Ready"),
        rank(1, "Ready"),
        rank(2, "Failed", "boom"),
        rank(3, "Draining"),
    ]
    found = [(e.type, e.reason, e.message) for e in rank_events(before, after)]
    assert found == [
        ("Normal", "RankJoined", "rank 0 is ready"),
        ("Warning", "RankFailed", "rank 2: boom"),
        ("Normal", "RankDraining", "rank 3 is draining"),
    ]
    assert rank_events(after, after) == []


def test_the_way_up_posts_only_the_join() -> None:
    steps = [
        [rank(0, "Pending", NO_POD)],
        [rank(0, "Pending", "ContainerCreating")],
        [rank(0, "Loading", "loading the model and warming up")],
        [rank(0, "Handshaking", "not yet joined the coordinator")],
        [rank(0, "Ready", "serving")],
    ]
    found = [e.reason for a, b in itertools.pairwise(steps) for e in rank_events(a, b)]
    assert found == ["RankJoined"]


def test_a_ready_rank_that_restarts_or_vanishes_is_reported() -> None:
    ready = [rank(0, "Ready", "serving", updated=True)]
    restarted = [rank(0, "Loading", "restarted after exit code 137; loading again")]
    [event] = rank_events(ready, restarted)
    assert (event.type, event.reason) == ("Warning", "RankNotReady")
    assert "restarted after exit code 137" in event.message
    [event] = rank_events(ready, [rank(0, "Pending", NO_POD)])
    assert (event.type, event.reason) == ("Warning", "RankLost")
    assert "llama-engine-0" in event.message
    # An outdated rank's pod goes because the rolling update deleted it (RankReplaced said so).
    outdated = [rank(0, "Ready", "serving", updated=False)]
    assert rank_events(outdated, [rank(0, "Pending", NO_POD)]) == []
    # A draining or failed rank's pod is expected to go.
    assert rank_events([rank(0, "Draining")], [rank(0, "Pending", NO_POD)]) == []
    assert rank_events([rank(0, "Failed", "x")], [rank(0, "Pending", NO_POD)]) == []


def test_scale_down_removes_ranks_and_waits_for_nodes_warn() -> None:
    before = [rank(0, "Ready"), rank(1, "Draining"), rank(2, "Draining")]
    after = [rank(0, "Ready")]
    found = [(e.reason, e.message) for e in rank_events(before, after)]
    assert found == [
        ("RankRemoved", "rank 1 removed (llama-engine-1 is gone)"),
        ("RankRemoved", "rank 2 removed (llama-engine-2 is gone)"),
    ]
    unschedulable = [
        rank(0, "Scheduling", "0/3 nodes are available: 3 Insufficient nvidia.com/gpu")
    ]
    [event] = rank_events([rank(0, "Pending", NO_POD)], unschedulable)
    assert (event.type, event.reason) == ("Warning", "RankUnschedulable")
    assert "Insufficient nvidia.com/gpu" in event.message


def test_coordinator_transitions() -> None:
    assert reasons({}, {"coordinatorReady": False}) == []  # a new engine: nothing changed yet
    assert reasons({}, {"coordinatorReady": True}) == []  # an older operator's status
    assert reasons({"coordinatorReady": False}, {"coordinatorReady": True}) == [
        ("Normal", "CoordinatorReady")
    ]
    assert reasons({"coordinatorReady": True}, {"coordinatorReady": False}) == [
        ("Warning", "CoordinatorUnavailable")
    ]
    assert reasons({"coordinatorReady": True}, {"coordinatorReady": True}) == []


def progressing(reason: str, message: str = "") -> dict[str, Any]:
    """A status with its Progressing condition (and 2 updated ranks)."""
    condition = {"type": "Progressing", "status": "True", "reason": reason, "message": message}
    return {"conditions": [condition], "updatedReplicas": 2}


def test_rollout_start_and_end() -> None:
    started = transition_events(
        progressing("Complete"),
        progressing("RollingUpdate", "ranks [0, 1] still run an older spec"),
    )
    assert [(e.reason, e.message) for e in started] == [
        ("RolloutStarted", "ranks [0, 1] still run an older spec")
    ]
    assert reasons(progressing("RollingUpdate"), progressing("RollingUpdate")) == []
    done = transition_events(progressing("RollingUpdate"), progressing("Complete"))
    assert [(e.reason, e.message) for e in done] == [
        ("RolloutComplete", "every rank runs the current spec (2 updated)")
    ]
    assert reasons(progressing("RanksStarting"), progressing("Complete")) == []


def test_an_unchanged_status_posts_nothing() -> None:
    status = {
        "coordinatorReady": True,
        "ranks": [rank(0, "Ready"), rank(1, "Failed", "boom")],
        **progressing("RollingUpdate"),
    }
    assert transition_events(status, dict(status)) == []
