"""Rank stages from pod conditions, conditions from ranks, Events from stage changes."""

from __future__ import annotations

import datetime
import json

import pytest
from operator_fixtures import CURRENT, NOW, OLD, OWNER, children, pod, spec

from corefleet.operator.pods import diagnose
from corefleet.operator.reconcile import Observed, plan
from corefleet.operator.status import Context, compute_status

RECENT = (NOW - datetime.timedelta(seconds=30)).strftime("%Y-%m-%dT%H:%M:%SZ")


def with_status(status: dict, **meta) -> dict:
    body = pod(0)
    body["status"] = status
    body["metadata"].update(meta)
    body["spec"] = {"containers": [{"image": "ghcr.io/x/engine:1"}]}
    return body


def container(**fields) -> dict:
    return {
        "phase": "Running",
        "conditions": [{"type": "Ready", "status": "False"}],
        "containerStatuses": [{"name": "engine", "restartCount": 0, **fields}],
    }


DIAGNOSES = {
    "ready": (pod(0), None, ("Ready", "Ready")),
    "no status yet": (with_status({}), None, ("Pending", "Pending")),
    "creating": (
        with_status(container(state={"waiting": {"reason": "ContainerCreating"}})),
        None,
        ("Pending", "Pending"),
    ),
    "no gpu": (
        with_status(
            {
                "phase": "Pending",
                "conditions": [
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu.",
                    }
                ],
            }
        ),
        None,
        ("Scheduling", "InsufficientGPU"),
    ),
    "no claim": (
        with_status(
            {
                "phase": "Pending",
                "conditions": [
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": 'persistentvolumeclaim "weights" not found',
                    }
                ],
            }
        ),
        None,
        ("Scheduling", "ModelVolumeNotFound"),
    ),
    "image pull": (
        with_status(
            container(
                state={
                    "waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling image"}
                }
            )
        ),
        None,
        ("Failed", "ImagePullBackOff"),
    ),
    "crash loop": (
        with_status(
            container(
                restartCount=3,
                state={"waiting": {"reason": "CrashLoopBackOff"}},
                lastState={"terminated": {"reason": "Error", "exitCode": 1}},
            )
        ),
        None,
        ("Failed", "CrashLoopBackOff"),
    ),
    "layout the model cannot take": (
        with_status(
            container(
                restartCount=3,
                state={"waiting": {"reason": "CrashLoopBackOff"}},
                lastState={
                    "terminated": {
                        "reason": "Error",
                        "exitCode": 1,
                        # What the rank writes to /dev/termination-log (engine_core/entry.py).
                        "message": "ValueError: invalid engine argument tensor_parallel_size=2: "
                        "the model has 9 attention heads, which 2 workers cannot split evenly\n"
                        + "x"
                        * 10_000,
                    }
                },
            )
        ),
        None,
        ("Failed", "InvalidEngineArgument"),
    ),
    "oom loop": (
        with_status(
            container(
                restartCount=3,
                state={"waiting": {"reason": "CrashLoopBackOff"}},
                lastState={"terminated": {"reason": "OOMKilled", "exitCode": 137}},
            )
        ),
        None,
        ("Failed", "OOMKilled"),
    ),
    "flapping but momentarily ready": (
        with_status(
            {
                **container(
                    restartCount=5,
                    state={"running": {}},
                    lastState={
                        "terminated": {"reason": "Error", "exitCode": 1, "finishedAt": RECENT}
                    },
                ),
                "conditions": [{"type": "Ready", "status": "True"}],
            }
        ),
        None,
        ("Failed", "CrashLoopBackOff"),
    ),
    "evicted": (
        with_status({"phase": "Failed", "reason": "Evicted", "message": "low on memory"}),
        None,
        ("Failed", "Evicted"),
    ),
    "loading": (with_status(container(state={"running": {}})), None, ("Loading", "Loading")),
    "not joined yet": (
        with_status(container(state={"running": {}})),
        "absent",
        ("Handshaking", "Handshaking"),
    ),
    "restarted once, reloading": (
        with_status(
            container(
                restartCount=1,
                state={"running": {}},
                lastState={"terminated": {"reason": "Error", "exitCode": 137}},
            )
        ),
        "absent",
        ("Loading", "Restarted"),
    ),
    "terminating": (pod(0, terminating=True), None, ("Draining", "Draining")),
    "ready but draining": (pod(0), "draining", ("Draining", "Draining")),
}


@pytest.mark.parametrize("name", sorted(DIAGNOSES))
def test_diagnose(name):
    body, joined, (stage, reason) = DIAGNOSES[name]
    found = diagnose(body, NOW, joined)
    assert (found.stage, found.reason) == (stage, reason), found.message


def test_messages_name_the_cause():
    assert "Insufficient nvidia.com/gpu" in diagnose(DIAGNOSES["no gpu"][0], NOW).message
    assert "ghcr.io/x/engine:1" in diagnose(DIAGNOSES["image pull"][0], NOW).message
    assert "OOMKilled (code 137)" in diagnose(DIAGNOSES["oom loop"][0], NOW).message
    assert "Error (code 137)" in diagnose(DIAGNOSES["restarted once, reloading"][0], NOW).message
    layout = diagnose(DIAGNOSES["layout the model cannot take"][0], NOW).message
    assert "9 attention heads, which 2 workers cannot split" in layout
    assert len(layout) < 500  # the rank's message, first line and bounded


def test_a_rank_restarted_in_place_degrades_until_ready_again():
    lost = with_status(
        container(
            restartCount=1,
            state={"running": {}},
            lastState={"terminated": {"reason": "Error", "exitCode": 137}},
        )
    )
    status = status_for(2, [pod(0), lost])
    assert conditions(status)["Degraded"] == ("True", "RankRestarted")
    assert conditions(status)["Ready"] == ("False", "RanksNotReady")
    back = json.loads(json.dumps(lost))
    back["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
    assert conditions(status_for(2, [pod(0), back]))["Degraded"] == ("False", "AllRanksHealthy")


def status_for(ranks: int, pods: list, previous: dict | None = None, **ctx):
    observed = Observed(
        pods={int(p["metadata"]["labels"]["corefleet.dev/rank"]): p for p in pods},
        children=children(),
    )
    result = plan(OWNER, spec(ranks), observed, NOW)
    context = Context(
        generation=ctx.pop("generation", 1),
        coordinator_ready=ctx.pop("coordinator_ready", True),
        **ctx,
    )
    return compute_status(OWNER, spec(ranks), observed, result, context, previous or {}, NOW)


def conditions(status: dict) -> dict:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_all_ranks_ready():
    status = status_for(2, [pod(0), pod(1)])
    assert conditions(status) == {
        "Ready": ("True", "AllRanksReady"),
        "Progressing": ("False", "Complete"),
        "Degraded": ("False", "AllRanksHealthy"),
    }
    assert status["rankSummary"] == "2/2" and status["readyReplicas"] == 2
    assert status["endpoint"] == "http://llama-coordinator.default.svc:8000"
    assert [r["stage"] for r in status["ranks"]] == ["Ready", "Ready"]
    assert all(c["observedGeneration"] == 1 for c in status["conditions"])


STATUS_CASES = {
    "coordinator down": (
        2,
        [pod(0), pod(1)],
        {"coordinator_ready": False},
        {"Ready": ("False", "CoordinatorUnavailable")},
    ),
    "scaling up": (
        3,
        [pod(0), pod(1)],
        {},
        {"Ready": ("False", "RanksNotReady"), "Progressing": ("True", "RanksStarting")},
    ),
    "scaling down": (
        1,
        [pod(0), pod(1, terminating=True)],
        {},
        {"Progressing": ("True", "ScalingDown")},
    ),
    "rolling": (
        2,
        [pod(0, hash=OLD), pod(1)],
        {},
        {"Ready": ("True", "AllRanksReady"), "Progressing": ("True", "RollingUpdate")},
    ),
    "crash loop": (
        2,
        [pod(0), DIAGNOSES["crash loop"][0]],
        {},
        {"Ready": ("False", "RankFailed"), "Degraded": ("True", "CrashLoopBackOff")},
    ),
    "deadline": (
        2,
        [pod(0, hash=OLD), pod(1, ready=False, age=400)],
        {},
        {
            "Progressing": ("False", "ProgressDeadlineExceeded"),
            "Degraded": ("True", "ProgressDeadlineExceeded"),
        },
    ),
    "volume": (
        1,
        [pod(0, ready=False)],
        {"volume_missing": True},
        {"Degraded": ("True", "ModelVolumeNotFound")},
    ),
    "zero": (0, [], {}, {"Ready": ("False", "ScaledToZero"), "Progressing": ("False", "Complete")}),
}


@pytest.mark.parametrize("name", sorted(STATUS_CASES))
def test_conditions(name):
    ranks, pods, ctx, expected = STATUS_CASES[name]
    found = conditions(status_for(ranks, pods, **ctx))
    assert {k: found[k] for k in expected} == expected


def test_transition_time_is_kept_while_the_status_stays():
    first = status_for(2, [pod(0), pod(1)])
    earlier = {
        **first,
        "conditions": [
            {**c, "lastTransitionTime": "2026-01-01T00:00:00Z"} for c in first["conditions"]
        ],
    }
    same = status_for(2, [pod(0), pod(1)], previous=earlier)
    assert {c["lastTransitionTime"] for c in same["conditions"]} == {"2026-01-01T00:00:00Z"}
    changed = status_for(2, [pod(0), pod(1, ready=False, age=10)], previous=earlier)
    times = {c["type"]: c["lastTransitionTime"] for c in changed["conditions"]}
    assert times["Ready"] == "2026-06-01T12:00:00Z"
    assert times["Degraded"] == "2026-01-01T00:00:00Z"


def test_missing_rank_is_pending_and_updated_flags_follow_the_hash():
    status = status_for(2, [pod(0, hash=OLD)])
    assert status["ranks"][1] == {
        "rank": 1,
        "pod": "llama-engine-1",
        "stage": "Pending",
        "message": "pod not created yet",
    }
    assert status["ranks"][0]["updated"] is False and status["updatedReplicas"] == 0
    assert CURRENT != OLD


def test_a_rolling_update_lasts_until_the_replaced_ranks_serve():
    rolling = status_for(2, [pod(0, hash=OLD), pod(1)])
    assert conditions(rolling)["Progressing"] == ("True", "RollingUpdate")
    # Rank 0 was replaced: its new pod loads. Still the rollout, not a plain start.
    starting = status_for(2, [pod(0, ready=False, age=10), pod(1)], previous=rolling)
    assert conditions(starting)["Progressing"] == ("True", "RollingUpdate")
    assert "of the current spec are starting" in starting["conditions"][1]["message"]
    done = status_for(2, [pod(0), pod(1)], previous=starting)
    assert conditions(done)["Progressing"] == ("False", "Complete")
    # Without a rollout before, a loading rank is just starting.
    assert conditions(status_for(2, [pod(0, ready=False, age=10), pod(1)]))["Progressing"] == (
        "True",
        "RanksStarting",
    )
    assert status_for(2, [pod(0), pod(1)])["coordinatorReady"] is True


def test_coordinator_summary_is_reported_once_the_deployment_is_seen():
    assert "coordinatorSummary" not in status_for(1, [pod(0)])
    assert status_for(1, [pod(0)], coordinators="1/2")["coordinatorSummary"] == "1/2"
