"""The real operator against a real API server: apply, scale, roll, delete, restart.

The operator runs with the chart's RBAC for `-n default`; the test plays the kubelet (pod
status) and, without the controller manager, the Deployment controller. Deleting an engine runs
the real garbage collector (the controller manager).
"""

from __future__ import annotations

import base64

from audit_log import by_user, ref
from chart_install import OPERATOR_USER
from operator_harness import (
    CHILDREN,
    IE,
    IE_URL,
    Cluster,
    engine_manifest,
    eventually,
    printer_columns,
    run,
)
from operator_run import DELETED, running_operator
from real_cluster import RealCluster, real_cluster

DO_NOT_DISRUPT = "karpenter.sh/do-not-disrupt"
ENGINE_SELECTOR = "corefleet.dev/engine=llama"


def _uids(c: Cluster) -> dict[int, str]:
    return {rank: pod["metadata"]["uid"] for rank, pod in c.pods().items()}


def _hashes(c: Cluster) -> dict[int, str]:
    return {r: p["metadata"]["annotations"]["corefleet.dev/spec-hash"] for r, p in c.pods().items()}


def _children_exist(c: Cluster) -> bool:
    return all(
        {o["metadata"]["name"] for o in c.objs(path, "default")} >= names
        for path, names in CHILDREN.items()
    )


async def _ready_engine(c: Cluster, ranks: int) -> None:
    await c.apply(engine_manifest(ranks=ranks))
    await eventually(lambda: len(c.pods()) == ranks and _children_exist(c), what="children")
    await c.all_ready()
    await eventually(lambda: c.condition("Ready").get("status") == "True", what="Ready")


def test_apply_creates_every_child_with_owner_references(tmp_path):
    async def scenario():
        async with real_cluster(tmp_path) as c, running_operator():
            await c.apply(engine_manifest(ranks=2))
            await eventually(lambda: len(c.pods()) == 2 and _children_exist(c), what="children")
            uid = c.engine()["metadata"]["uid"]
            for path, names in {
                **CHILDREN,
                "v1/pods": {"llama-engine-0", "llama-engine-1"},
            }.items():
                for name in names:
                    refs = c.obj(path, "default", name)["metadata"]["ownerReferences"]
                    assert [(r["kind"], r["uid"], r["controller"]) for r in refs] == [
                        ("InferenceEngine", uid, True)
                    ], (path, name)
            await eventually(lambda: c.status().get("rankSummary") == "0/2", what="status")
            assert printer_columns(c.engine())["READY"] == "False"
            assert c.condition("Ready")["reason"] in ("CoordinatorUnavailable", "RanksNotReady")
            assert all(
                p["metadata"]["annotations"][DO_NOT_DISRUPT] == "true" for p in c.pods().values()
            )

            await c.all_ready()
            await eventually(lambda: c.condition("Ready").get("status") == "True", what="Ready")
            columns = printer_columns(c.engine())
            assert columns["RANKS"] == "2/2" and columns["READY"] == "True"
            assert columns["ENDPOINT"] == "http://llama-coordinator.default.svc:8000"
            assert columns["AGE"] == c.engine()["metadata"]["creationTimestamp"]
            status = c.status()
            assert [r["stage"] for r in status["ranks"]] == ["Ready", "Ready"]
            assert status["replicas"] == status["readyReplicas"] == status["updatedReplicas"] == 2
            assert status["observedGeneration"] == 1
            assert (
                status["selector"]
                == "corefleet.dev/engine=llama,app.kubernetes.io/component=engine"
            )
            await eventually(
                lambda: all(
                    DO_NOT_DISRUPT not in p["metadata"]["annotations"] for p in c.pods().values()
                ),
                what="guards released",
            )
            await eventually(lambda: len(c.events("RankJoined")) == 2, what="join events")
            assert len(c.events("RankCreated")) == 2

            meta = c.engine()["metadata"]
            assert meta["finalizers"] == ["operator.corefleet.dev/finalizer"]
            assert all(not k.startswith("kopf.zalando.org") for k in meta.get("annotations", {}))
            assert set(c.status()) == {
                "observedGeneration",
                "replicas",
                "readyReplicas",
                "updatedReplicas",
                "rankSummary",
                "selector",
                "endpoint",
                "coordinatorReady",
                "coordinatorSummary",
                "ranks",
                "conditions",
            }  # nothing of kopf's in status
            secret = c.obj("v1/secrets", "default", "llama-curve")["data"]
            keys = {k: base64.b64decode(v).decode() for k, v in secret.items()}
            assert sorted(keys) == [
                "client-public",
                "client-secret",
                "server-public",
                "server-secret",
            ]
            assert all(len(v) == 40 for v in keys.values()) and len(set(keys.values())) == 4

    run(scenario())


def test_scale_subresource_adds_and_removes_highest_ranks(tmp_path):
    """Scaled pods drain: the stand-in kubelet binds them and ends a deleted one 0.5 s later."""

    async def scenario():
        async with (
            real_cluster(tmp_path, pod_termination_seconds=0.5) as c,
            running_operator(),
        ):
            await _ready_engine(c, 2)
            scale = await c.scale(4)
            assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 4
            await eventually(lambda: sorted(c.pods()) == [0, 1, 2, 3], what="ranks 2 and 3")
            assert c.engine()["spec"]["dataParallelSize"] == 4
            await eventually(lambda: c.status().get("rankSummary") == "2/4", what="2/4")
            for rank in (2, 3):
                await c.pod_ready(f"llama-engine-{rank}")
            await eventually(lambda: c.status().get("rankSummary") == "4/4", what="4/4")
            scale = await c.request("GET", f"{IE_URL}/llama/scale")
            assert scale["status"] == {"replicas": 4, "selector": c.status()["selector"]}
            rank0 = c.pods()[0]["metadata"]["uid"]

            await c.scale(1)
            await eventually(
                lambda: all(
                    c.pods()[r]["metadata"].get("deletionTimestamp")
                    for r in (1, 2, 3)
                    if r in c.pods()
                ),
                what="draining",
            )
            await eventually(
                lambda: (
                    {r["rank"]: r["stage"] for r in c.status()["ranks"]}.get(3)
                    in ("Draining", None)
                ),
                what="Draining stage",
            )
            await eventually(lambda: sorted(c.pods()) == [0], what="scaled to 1")
            assert c.pods()[0]["metadata"]["uid"] == rank0
            # in the audit log, which the server writes as it answers: poll for the third
            deletes = await eventually(
                lambda: len(_pod_deletes(c)) >= 3 and _pod_deletes(c), what="three deletes"
            )
            assert deletes == ["llama-engine-3", "llama-engine-2", "llama-engine-1"]
            assert c.kubelet is not None
            gone = [p["metadata"] for p in c.kubelet.finalized]
            assert sorted(m["name"] for m in gone) == [f"llama-engine-{r}" for r in (1, 2, 3)]
            assert all(m["annotations"][DO_NOT_DISRUPT] == "true" for m in gone)
            await eventually(
                lambda: (
                    c.status().get("rankSummary") == "1/1"
                    and [r["rank"] for r in c.status()["ranks"]] == [0]
                    and c.condition("Progressing").get("reason") == "Complete"
                ),
                what="status at 1",
            )
            assert c.status()["replicas"] == 1 and printer_columns(c.engine())["READY"] == "True"
            await eventually(lambda: len(c.events("RankScaledDown")) == 3, what="3 events")

    run(scenario())


def test_spec_change_rolls_ranks_one_at_a_time(tmp_path):
    async def scenario():
        async with real_cluster(tmp_path) as c, running_operator() as operator:
            await _ready_engine(c, 3)
            old = _hashes(c)
            await c.patch_spec({"engine": {"maxNumSeqs": 64}})
            for rank in (2, 1, 0):  # highest first, each only once the previous one is Ready
                await eventually(
                    lambda r=rank: _hashes(c).get(r, old[r]) != old[r], what=f"rank {rank} replaced"
                )
                assert sum(h == old[r] for r, h in _hashes(c).items()) == rank  # the rest: old
                await eventually(
                    lambda r=rank: (
                        c.condition("Progressing").get("reason") == "RollingUpdate" or r == 0
                    ),
                    what="RollingUpdate",
                )
                # The operator has seen the new pod (not Ready) and reconciled twice more since:
                # it still waits for it and replaces nothing else.
                await operator.log.ticks(2)
                assert sum(h == old[r] for r, h in _hashes(c).items()) == rank
                await c.pod_ready(f"llama-engine-{rank}")
            await eventually(
                lambda: (
                    c.condition("Progressing").get("reason") == "Complete"
                    and c.status().get("updatedReplicas") == 3
                ),
                what="rollout done",
            )
            assert c.status()["observedGeneration"] == 2
            args = c.obj("v1/configmaps", "default", "llama-engine-args")["data"]["args"]
            assert "--max-num-seqs 64" in args
            await eventually(lambda: len(c.events("RankReplaced")) == 3, what="3 events")

    run(scenario())


def test_failed_pod_is_replaced(tmp_path):
    async def scenario():
        async with real_cluster(tmp_path) as c, running_operator():
            await _ready_engine(c, 2)
            before = _uids(c)
            await c.set_pod(
                "llama-engine-1",
                {"phase": "Failed", "reason": "Evicted", "message": "The node was low on memory."},
            )
            await eventually(lambda: _uids(c).get(1, before[1]) != before[1], what="new rank 1")
            assert _uids(c)[0] == before[0]
            await eventually(lambda: c.events("RankFailedReplaced"), what="event")
            await eventually(
                lambda: c.status()["ranks"][1].get("replacements") == 1, what="replacement counted"
            )
            await c.pod_ready("llama-engine-1")
            await eventually(
                lambda: (
                    c.condition("Ready").get("status") == "True"
                    and "replacements" not in c.status()["ranks"][1]
                ),
                what="recovered",
            )

    run(scenario())


def _pod_deletes(c: RealCluster) -> list[str]:
    """The pods the operator deleted, in order."""
    return [ref(e)["name"] for e in c.audit.select("delete", "pods", by_user(OPERATOR_USER))]


def _llama_creates(c: RealCluster) -> list[str]:
    """Everything the operator ever created for the engine llama (any kind)."""
    creates = c.audit.select("create", user=by_user(OPERATOR_USER))
    return [
        f"{ref(e)['resource']}/{ref(e)['name']}"
        for e in creates
        if str(ref(e).get("name", "")).startswith("llama-")
    ]


def test_deleting_the_engine_stops_all_work(tmp_path):
    """The real garbage collector removes the children once the operator lets the engine go;
    nothing of it comes back, though the operator keeps working (another engine)."""

    async def scenario():
        async with (
            real_cluster(tmp_path, controller_manager=True) as c,
            running_operator() as operator,
        ):
            await _ready_engine(c, 2)
            await c.request("DELETE", f"{IE_URL}/llama")
            await eventually(lambda: c.obj(IE, "default", "llama") is None, what="engine gone")
            assert operator.log.count("llama", DELETED) == 1
            await eventually(
                lambda: (
                    not c.pods()
                    and not c.objs("v1/services", "default", ENGINE_SELECTOR)
                    and not c.objs("apps/v1/deployments", "default", ENGINE_SELECTOR)
                ),
                what="children collected",
            )
            created = _llama_creates(c)
            # A later engine: the operator watches, creates and reconciles on its timer; by then
            # it has long processed the events of llama's children going.
            await c.apply(engine_manifest("other", ranks=1))
            await eventually(lambda: 0 in c.pods("other"), what="the other engine's rank")
            await operator.log.ticks(2, "other")
            assert not c.pods() and not c.objs("apps/v1/deployments", "default", ENGINE_SELECTOR)
            assert _llama_creates(c) == created
            assert not operator.task.done()
        assert operator.task.done() and operator.task.exception() is None

    run(scenario())


def test_restarted_operator_resumes_and_recreates_a_lost_rank(tmp_path):
    async def scenario():
        async with real_cluster(tmp_path) as c:
            async with running_operator():
                await _ready_engine(c, 2)
            lost = c.pods()[1]["metadata"]["uid"]
            await c.request("DELETE", "/api/v1/namespaces/default/pods/llama-engine-1")
            async with running_operator():
                await eventually(
                    lambda: 1 in c.pods() and c.pods()[1]["metadata"]["uid"] != lost,
                    what="rank 1 recreated",
                )
                await eventually(lambda: c.status().get("rankSummary") == "1/2", what="1/2")

    run(scenario())
