"""Table tests of the pure reconcile: (spec, observed) -> actions."""

from __future__ import annotations

from typing import Any

import pytest
from operator_fixtures import KEYS, NOW, OLD, OWNER, children, pod, spec

from corefleet.operator.naming import DO_NOT_DISRUPT, HASH_ANNOTATION
from corefleet.operator.reconcile import Observed, Policy, plan


def summary(result) -> list[tuple[str, str, str]]:
    return [(a.verb, a.kind, a.name.removeprefix("llama-")) for a in result.actions]


def run(ranks: int, pods: list[dict[str, Any]], **kwargs: Any):
    observed = Observed(
        pods={int(p["metadata"]["labels"]["corefleet.dev/rank"]): p for p in pods},
        children=kwargs.pop("found", children()),
        replacements=kwargs.pop("replacements", {}),
    )
    return plan(OWNER, spec(ranks), observed, NOW, Policy(failed_backoff_seconds=10), **kwargs)


def test_fresh_engine_creates_every_child_then_every_rank():
    result = run(2, [], found={}, keys=KEYS)
    assert summary(result) == [
        ("create", "Secret", "curve"),
        ("create", "ConfigMap", "engine-args"),
        ("create", "Service", "engine"),
        ("create", "PodDisruptionBudget", "engine"),
        ("create", "Service", "coordinator"),
        ("create", "Service", "coordinators"),
        ("create", "PodDisruptionBudget", "coordinator"),
        ("create", "NetworkPolicy", "coordinator"),
        ("create", "Deployment", "coordinator"),
        ("create", "Pod", "engine-0"),
        ("create", "Pod", "engine-1"),
    ]
    assert result.actions[-1].body["metadata"]["annotations"][DO_NOT_DISRUPT] == "true"


def test_converged_engine_needs_nothing():
    result = run(3, [pod(0), pod(1), pod(2)])
    assert summary(result) == [] and result.waiting_for is None
    assert result.deadline_exceeded == ()


CASES = {
    "scale up creates the missing ranks": (
        4,
        [pod(0), pod(1)],
        [("create", "Pod", "engine-2"), ("create", "Pod", "engine-3")],
    ),
    "scale down deletes the highest ranks, guarded first": (
        1,
        [pod(r) for r in range(4)],
        [
            ("patch", "Pod", "engine-3"),
            ("delete", "Pod", "engine-3"),
            ("patch", "Pod", "engine-2"),
            ("delete", "Pod", "engine-2"),
            ("patch", "Pod", "engine-1"),
            ("delete", "Pod", "engine-1"),
        ],
    ),
    "a rank already draining is left alone": (
        1,
        [pod(0), pod(1), pod(2, terminating=True)],
        [("patch", "Pod", "engine-1"), ("delete", "Pod", "engine-1")],
    ),
    "scale to zero removes every rank": (
        0,
        [pod(0)],
        [("patch", "Pod", "engine-0"), ("delete", "Pod", "engine-0")],
    ),
    "rollout starts with the highest outdated rank": (
        3,
        [pod(0, hash=OLD), pod(1, hash=OLD), pod(2, hash=OLD)],
        [("delete", "Pod", "engine-2")],
    ),
    "rollout waits for the replaced rank to be Ready": (
        3,
        [pod(0, hash=OLD), pod(1, hash=OLD), pod(2, ready=False, age=60)],
        [],
    ),
    "rollout waits for a replaced rank to come back": (
        3,
        [pod(0, hash=OLD), pod(1, hash=OLD)],
        [("create", "Pod", "engine-2")],
    ),
    "rollout waits while the replaced pod still drains": (
        3,
        [pod(0, hash=OLD), pod(1, hash=OLD), pod(2, hash=OLD, terminating=True)],
        [],
    ),
    "rollout continues once the new rank is Ready": (
        3,
        [pod(0, hash=OLD), pod(1, hash=OLD), pod(2)],
        [("delete", "Pod", "engine-1")],
    ),
    "deadline escape: a never-Ready rank stops gating": (
        3,
        [pod(0, hash=OLD), pod(1, hash=OLD), pod(2, ready=False, age=301)],
        [("delete", "Pod", "engine-1")],
    ),
    "outdated ranks that serve nothing are replaced at once": (
        3,
        [pod(0, hash=OLD, ready=False), pod(1, hash=OLD, ready=False), pod(2, hash=OLD)],
        [("delete", "Pod", "engine-1"), ("delete", "Pod", "engine-0")],
    ),
    "a failed pod is replaced": (
        2,
        [pod(0), pod(1, phase="Failed", ready=False)],
        [("delete", "Pod", "engine-1")],
    ),
    "a Ready rank is released for autoscalers": (
        1,
        [pod(0, guarded=True)],
        [("patch", "Pod", "engine-0")],
    ),
    "a loading rank is guarded": (
        2,
        [pod(0), pod(1, ready=False, guarded=False, age=5)],
        [("patch", "Pod", "engine-1")],
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_reconcile_table(name):
    ranks, pods, expected = CASES[name]
    assert summary(run(ranks, pods)) == expected


def test_rollout_reports_what_it_waits_for_and_overdue_ranks():
    waiting = run(3, [pod(0, hash=OLD), pod(1, hash=OLD), pod(2, ready=False, age=60)])
    assert waiting.waiting_for == 2 and waiting.deadline_exceeded == ()
    late = run(3, [pod(0, hash=OLD), pod(1, hash=OLD), pod(2, ready=False, age=301)])
    assert late.deadline_exceeded == (2,)


def test_repeated_failures_back_off():
    failed = pod(1, phase="Failed", ready=False, age=15)
    first = run(2, [pod(0), failed])
    assert summary(first) == [("delete", "Pod", "engine-1")] and first.replacements == {1: 1}
    again = run(2, [pod(0), failed], replacements={1: 2})  # 2nd back-off: 20 s > 15 s of age
    assert summary(again) == [] and again.replacements == {1: 2}
    later = run(2, [pod(0), pod(1, phase="Failed", ready=False, age=25)], replacements={1: 2})
    assert summary(later) == [("delete", "Pod", "engine-1")] and later.replacements == {1: 3}
    recovered = run(2, [pod(0), pod(1)], replacements={1: 3})
    assert recovered.replacements == {}


def test_changed_children_are_patched_but_the_secret_never():
    found = children(**{"ConfigMap/llama-engine-args": "stale", "Secret/llama-curve": "stale"})
    result = run(1, [pod(0)], found=found, keys=KEYS)
    assert summary(result) == [("patch", "ConfigMap", "engine-args")]
    patch = result.actions[0].body
    assert set(patch) == {"metadata", "data"}
    assert patch["metadata"]["annotations"][HASH_ANNOTATION] != "stale"


def test_pure_no_keys_no_secret():
    found = {k: v for k, v in children().items() if k[0] != "Secret"}
    assert summary(run(1, [pod(0)], found=found)) == []
    assert summary(run(1, [pod(0)], found=found, keys=KEYS)) == [("create", "Secret", "curve")]


def _autoscaled(ranks: int = 1) -> Any:
    return spec(ranks, coordinator={"autoscaling": {"minReplicas": 2, "maxReplicas": 4}})


def test_autoscaling_adds_an_hpa_and_patches_the_deployment_without_replicas():
    found = children()
    observed = Observed(pods={0: pod(0)}, children=found)
    result = plan(OWNER, _autoscaled(), observed, NOW)
    assert summary(result) == [
        ("patch", "Deployment", "coordinator"),
        ("create", "HorizontalPodAutoscaler", "coordinator"),
    ]
    # The merge patch has no replicas: whatever the HPA set stays.
    assert "replicas" not in result.actions[0].body["spec"]
    # Converged: the HPA and the Deployment carry the current hashes, nothing to do, however
    # many replicas the HPA chose meanwhile (the reconcile compares hashes, not replicas).
    hashes = {
        (a.kind, a.name): a.body["metadata"]["annotations"][HASH_ANNOTATION] for a in result.actions
    }
    converged = Observed(pods={0: pod(0)}, children={**found, **hashes})
    assert summary(plan(OWNER, _autoscaled(), converged, NOW)) == []


def test_an_hpa_the_spec_no_longer_asks_for_is_deleted_and_replicas_return():
    hpa = ("HorizontalPodAutoscaler", "llama-coordinator")
    found = {**children(), hpa: "old", ("Deployment", "llama-coordinator"): "old"}
    result = plan(OWNER, spec(1), Observed(pods={0: pod(0)}, children=found), NOW)
    assert summary(result) == [
        ("patch", "Deployment", "coordinator"),
        ("delete", "HorizontalPodAutoscaler", "coordinator"),
    ]
    assert result.actions[0].body["spec"]["replicas"] == 1
    # Other kinds are never deleted by the reconcile, even under a name it does not build.
    stray = {**children(), ("Service", "llama-other"): "x", ("PodDisruptionBudget", "x"): "y"}
    assert summary(plan(OWNER, spec(1), Observed(pods={0: pod(0)}, children=stray), NOW)) == []
