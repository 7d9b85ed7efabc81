"""An expert-parallel group (spec.enableExpertParallel): its manifests, its rollout, its status.

The ranks of such an engine form one torch.distributed group that meets at rank 0's stable DNS
name and lives and dies whole. These tests pin what the operator does differently for it, and
that an ordinary fleet's manifests and spec hashes stay as they were (no roll on upgrade).
"""

from __future__ import annotations

import json
from typing import Any

from crdcheck import defaulted, errors
from operator_fixtures import KEYS, NOW, OLD, OWNER, pod, spec

from corefleet.operator import resources
from corefleet.operator.events import GROUP_RESTARTING, transition_events
from corefleet.operator.flags import engine_args, group_args
from corefleet.operator.naming import DO_NOT_DISRUPT, DP_GROUP_PORT, HASH_ANNOTATION, spec_hash
from corefleet.operator.reconcile import Observed, plan
from corefleet.operator.spec import EngineSpec
from corefleet.operator.status import Context, compute_status

ADDRESS = "llama-engine-0.llama-engine:29550"


def group(ranks: int, **extra: Any) -> EngineSpec:
    """An expert-parallel spec of `ranks` ranks."""
    return spec(ranks, enableExpertParallel=True, **extra)


def group_hash(ranks: int) -> str:
    """The spec hash of a group of `ranks` ranks (the size is part of it)."""
    return spec_hash(resources.engine_pod_template("llama", group(ranks)))


def member(rank: int, ranks: int = 3, **kwargs: Any) -> dict[str, Any]:
    """A pod of a group of `ranks` ranks: current hash and guarded unless told otherwise."""
    kwargs.setdefault("hash", group_hash(ranks))
    kwargs.setdefault("guarded", True)
    return pod(rank, **kwargs)


def observed(the_spec: EngineSpec, pods: list[dict[str, Any]]) -> Observed:
    """`pods` and every other child as `the_spec` builds it (nothing to create or patch)."""
    found = {
        (c["kind"], c["metadata"]["name"]): c["metadata"]["annotations"][HASH_ANNOTATION]
        for c in resources.build_children(OWNER, the_spec, KEYS)
    }
    return Observed(
        pods={int(p["metadata"]["labels"]["corefleet.dev/rank"]): p for p in pods},
        children=found,
    )


def rank_actions(the_spec: EngineSpec, pods: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(verb, pod) of the plan's creations and deletions of rank pods."""
    result = plan(OWNER, the_spec, observed(the_spec, pods), NOW)
    return [
        (a.verb, a.name.removeprefix("llama-"))
        for a in result.actions
        if a.kind == "Pod" and a.verb in ("create", "delete")
    ]


# --- manifests -------------------------------------------------------------------------------


def test_rank_pods_join_the_group_at_rank_zeros_stable_name():
    pod_body = resources.build_engine_pod(OWNER, group(4), 2)
    container = pod_body["spec"]["containers"][0]
    args = container["args"]
    assert args[3:5] == ["--rank", "2"]
    tail = args[args.index("--data-parallel-size") :]
    assert tail == [
        "--data-parallel-size",
        "4",
        "--data-parallel-address",
        ADDRESS,
        "--enable-expert-parallel",
    ]
    # The address is rank 0's hostname under the headless Service, the pods' subdomain.
    service = resources.build_engine_service(OWNER, group(4))
    rank_zero = resources.engine_pod_name("llama", 0)
    assert f"{rank_zero}.{service['metadata']['name']}:{DP_GROUP_PORT}" == ADDRESS
    assert pod_body["spec"]["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["publishNotReadyAddresses"] is True  # resolves while rank 0 loads
    assert container["ports"] == [
        {"name": "health", "containerPort": 8001, "protocol": "TCP"},
        {"name": "dp-group", "containerPort": 29550, "protocol": "TCP"},
    ]
    assert service["spec"]["ports"][1] == {
        "name": "dp-group",
        "port": 29550,
        "targetPort": "dp-group",
        "protocol": "TCP",
    }
    # The ConfigMap shows what every rank runs, the group's flags included.
    data = resources.build_args_configmap(OWNER, group(4))["data"]
    assert json.loads(data["args.json"])[-5:] == tail


def test_an_ordinary_fleet_is_built_exactly_as_before():
    ordinary = spec(4)
    assert group_args("llama", ordinary) == []
    assert "--data-parallel-size" not in engine_args(ordinary)
    # The Service and the budget built from the spec equal the spec-less builders' (which the
    # golden manifests pin), hashes included: nothing is patched, no pod rolls.
    assert resources.build_engine_service(OWNER, ordinary) == resources.build_engine_service(OWNER)
    assert resources.build_pod_disruption_budget(
        OWNER, ordinary
    ) == resources.build_pod_disruption_budget(OWNER)
    explicit = spec(4, enableExpertParallel=False)
    template = resources.engine_pod_template("llama", ordinary)
    assert spec_hash(resources.engine_pod_template("llama", explicit)) == spec_hash(template)
    assert [p["name"] for p in template["containers"][0]["ports"]] == ["health"]


def test_a_scale_changes_every_ranks_hash_only_for_a_group():
    assert group_hash(3) != group_hash(4)
    ordinary = [spec_hash(resources.engine_pod_template("llama", spec(n))) for n in (3, 4)]
    assert ordinary[0] == ordinary[1]
    # Turning expert parallelism on rolls the ranks (their command line changes).
    assert group_hash(3) != ordinary[0]


def test_the_groups_budget_lets_a_drain_stop_the_group_once():
    budget = resources.build_pod_disruption_budget(OWNER, group(4))["spec"]
    assert budget["maxUnavailable"] == "100%"
    assert resources.build_pod_disruption_budget(OWNER)["spec"]["maxUnavailable"] == 1
    built = resources.build_children(OWNER, group(4), KEYS)
    assert ("PodDisruptionBudget", budget) in [(c["kind"], c.get("spec")) for c in built]


# --- reconcile -------------------------------------------------------------------------------


def test_a_group_is_replaced_whole_an_ordinary_fleet_one_rank_at_a_time():
    old = [member(r, hash=OLD) for r in range(3)]
    assert rank_actions(group(3), old) == [
        ("delete", "engine-2"),
        ("delete", "engine-1"),
        ("delete", "engine-0"),
    ]
    result = plan(OWNER, group(3), observed(group(3), old), NOW)
    assert result.waiting_for is None
    assert all("whole expert-parallel group" in a.message for a in result.actions)
    ordinary = [pod(r, hash=OLD) for r in range(3)]
    assert rank_actions(spec(3), ordinary) == [("delete", "engine-2")]


def test_a_scale_up_replaces_the_group_and_creates_only_once_the_old_pods_are_gone():
    two = [member(r, ranks=2) for r in range(2)]
    assert rank_actions(group(4), two) == [("delete", "engine-1"), ("delete", "engine-0")]
    draining = [member(r, ranks=2, terminating=True) for r in range(2)]
    assert rank_actions(group(4), draining) == []  # ranks 2 and 3 would dial the old rank 0
    # Once the old rank 0 is gone, the new group starts; rank 1 waits for its own old pod.
    assert rank_actions(group(4), draining[1:]) == [
        ("create", "engine-0"),
        ("create", "engine-2"),
        ("create", "engine-3"),
    ]
    assert rank_actions(group(4), []) == [("create", f"engine-{r}") for r in range(4)]
    # An ordinary fleet just adds ranks.
    assert rank_actions(spec(4), [pod(0), pod(1)]) == [
        ("create", "engine-2"),
        ("create", "engine-3"),
    ]


def test_a_scale_down_stops_the_whole_group():
    four = [member(r, ranks=4) for r in range(4)]
    assert rank_actions(group(2), four) == [
        ("delete", "engine-3"),
        ("delete", "engine-2"),
        ("delete", "engine-1"),
        ("delete", "engine-0"),
    ]


def test_a_finished_old_rank_zero_does_not_hold_the_new_group():
    # It never runs again, so it cannot answer for rank 0; rule 3 deletes it (with back-off).
    finished = member(0, hash=OLD, phase="Failed", ready=False, age=5)
    assert rank_actions(group(3), [finished]) == [
        ("delete", "engine-0"),
        ("create", "engine-1"),
        ("create", "engine-2"),
    ]


def test_a_lost_rank_is_recreated_at_once_and_its_peers_are_left_to_the_kubelet():
    assert rank_actions(group(3), [member(0), member(2)]) == [("create", "engine-1")]
    failed = member(1, phase="Failed", ready=False)
    assert rank_actions(group(3), [member(0), failed, member(2)]) == [("delete", "engine-1")]


def test_a_groups_ranks_stay_guarded_from_autoscalers_while_ready():
    # Moving one rank for cost would stop the whole group; a drain still may (the budget).
    pods = [member(0, ranks=2, guarded=False), member(1, ranks=2)]
    [guard] = plan(OWNER, group(2), observed(group(2), pods), NOW).actions
    assert (guard.name, guard.reason) == ("llama-engine-0", "GroupGuard")
    assert guard.body["metadata"]["annotations"][DO_NOT_DISRUPT] == "true"
    pods = [member(0, ranks=2), member(1, ranks=2)]
    assert plan(OWNER, group(2), observed(group(2), pods), NOW).actions == ()


def test_a_groups_late_ranks_are_reported_but_wait_for_nobody():
    late = [member(r, ranks=2, ready=False, age=301) for r in range(2)]
    result = plan(OWNER, group(2), observed(group(2), late), NOW)
    assert result.deadline_exceeded == (0, 1) and result.waiting_for is None


# --- status and events -----------------------------------------------------------------------


def status_for(the_spec: EngineSpec, pods: list[dict[str, Any]], previous=None, **ctx):
    seen = observed(the_spec, pods)
    result = plan(OWNER, the_spec, seen, NOW)
    context = Context(generation=1, coordinator_ready=ctx.pop("coordinator_ready", True), **ctx)
    return compute_status(OWNER, the_spec, seen, result, context, previous or {}, NOW)


def ready_condition(status: dict[str, Any]) -> tuple[str, str, str]:
    cond = next(c for c in status["conditions"] if c["type"] == "Ready")
    return cond["status"], cond["reason"], cond["message"]


def restarted(rank: int, ranks: int = 3) -> dict[str, Any]:
    """A rank whose process died and that the kubelet restarted in place: loading again."""
    body = member(rank, ranks=ranks, ready=False)
    body["status"]["containerStatuses"] = [
        {
            "name": "engine",
            "restartCount": 1,
            "state": {"running": {}},
            "lastState": {"terminated": {"reason": "Error", "exitCode": 1}},
        }
    ]
    return body


def test_a_rank_restarting_in_place_says_the_whole_group_restarts():
    whole = status_for(group(3), [member(r) for r in range(3)])
    assert ready_condition(whole)[:2] == ("True", "AllRanksReady")
    lost = status_for(group(3), [member(0), restarted(1), member(2)], previous=whole)
    status, reason, message = ready_condition(lost)
    assert (status, reason) == ("False", GROUP_RESTARTING)
    assert message.startswith("ranks [1] of the expert-parallel group are not ready (2/3 ready)")
    assert "the group's 3 ranks restart together" in message
    assert "the coordinator migrates their streams once the group is back" in message
    degraded = next(c for c in lost["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "RankRestarted"
    # The same pods in an ordinary fleet: just a rank not ready.
    plain = status_for(spec(3), [pod(0), restarted(1), pod(2)])
    assert ready_condition(plain)[1] == "RanksNotReady"
    assert plain["conditions"][0]["reason"] != GROUP_RESTARTING


def test_an_evicted_or_vanished_rank_that_served_starts_a_group_restart():
    whole = status_for(group(3), [member(r) for r in range(3)])
    evicted = [member(0), member(1, terminating=True), member(2)]
    assert ready_condition(status_for(group(3), evicted, previous=whole))[1] == GROUP_RESTARTING
    vanished = [member(0), member(2)]
    assert ready_condition(status_for(group(3), vanished, previous=whole))[1] == GROUP_RESTARTING


def test_the_reason_lasts_until_the_group_is_whole_and_outranks_the_coordinators():
    whole = status_for(group(3), [member(r) for r in range(3)])
    lost = status_for(group(3), [member(0), restarted(1), member(2)], previous=whole)
    # The peers exited on their failed collective; rank 1's new pod loads from scratch. No rank
    # is ready, so neither is any coordinator: the group is still the reason.
    reforming = [restarted(0), member(1, ready=False, age=5), restarted(2)]
    down = status_for(group(3), reforming, previous=lost, coordinator_ready=False)
    _, reason, message = ready_condition(down)
    assert reason == GROUP_RESTARTING and "ranks [0, 1, 2]" in message and "(0/3 ready)" in message
    fresh = [member(r, ready=False, age=5) for r in range(3)]
    assert ready_condition(status_for(group(3), fresh, previous=down))[1] == GROUP_RESTARTING
    back = status_for(group(3), [member(r) for r in range(3)], previous=down)
    assert ready_condition(back)[:2] == ("True", "AllRanksReady")
    events = {(e.type, e.reason): e.message for e in transition_events(lost, back)}
    assert events[("Normal", "ExpertParallelGroupReady")].endswith("(3/3 ranks ready)")
    start = {(e.type, e.reason) for e in transition_events(whole, lost)}
    assert ("Warning", GROUP_RESTARTING) in start
    assert not any(e.reason == GROUP_RESTARTING for e in transition_events(lost, down))


def test_a_group_forming_for_the_first_time_or_rolling_is_not_restarting():
    loading = status_for(group(3), [member(r, ready=False, age=5) for r in range(3)])
    assert ready_condition(loading)[1] == "RanksNotReady"
    whole = status_for(group(3), [member(r) for r in range(3)])
    rolling = status_for(group(3), [member(r, hash=OLD, terminating=True) for r in range(3)], whole)
    assert ready_condition(rolling)[1] == "RanksNotReady"
    assert next(c for c in rolling["conditions"] if c["type"] == "Progressing")["reason"] == (
        "RollingUpdate"
    )


def test_a_crash_looping_rank_is_still_reported_as_failed():
    looping = restarted(1)
    looping["status"]["containerStatuses"][0].update(
        restartCount=3,
        state={"waiting": {"reason": "CrashLoopBackOff"}},
    )
    whole = status_for(group(3), [member(r) for r in range(3)])
    status = status_for(group(3), [member(0), looping, member(2)], previous=whole)
    assert ready_condition(status)[1] == "RankFailed"


def test_the_group_status_fits_the_crds_status_schema():
    whole = status_for(group(3), [member(r) for r in range(3)])
    lost = status_for(group(3), [member(0), restarted(1), member(2)], previous=whole)
    body = {
        "apiVersion": "corefleet.dev/v1alpha1",
        "kind": "InferenceEngine",
        "metadata": {"name": "llama", "namespace": "default"},
        "spec": {"image": "i", "model": {"path": "/m"}, "enableExpertParallel": True},
    }
    assert errors({**defaulted(body), "status": lost}) == []
    assert lost["conditions"][0]["lastTransitionTime"] == NOW.strftime("%Y-%m-%dT%H:%M:%SZ")
