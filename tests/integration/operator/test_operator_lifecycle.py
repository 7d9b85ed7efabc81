"""The real operator against the emulator: apply, scale, roll, delete, restart."""

from __future__ import annotations

import asyncio
import base64

from operator_harness import (
    CHILDREN,
    IE_URL,
    Cluster,
    cluster,
    engine_manifest,
    events,
    eventually,
    printer_columns,
    run,
    running_operator,
)

DO_NOT_DISRUPT = "karpenter.sh/do-not-disrupt"


def _uids(c: Cluster) -> dict[int, str]:
    return {rank: pod["metadata"]["uid"] for rank, pod in c.pods().items()}


def _hashes(c: Cluster) -> dict[int, str]:
    return {r: p["metadata"]["annotations"]["corefleet.dev/spec-hash"] for r, p in c.pods().items()}


def _children_exist(c: Cluster) -> bool:
    return all(
        {o["metadata"]["name"] for o in c.emu.objs(path, "default")} >= names
        for path, names in CHILDREN.items()
    )


async def _ready_engine(c: Cluster, ranks: int) -> None:
    await c.apply(engine_manifest(ranks=ranks))
    await eventually(lambda: len(c.pods()) == ranks and _children_exist(c), what="children")
    await c.all_ready()
    await eventually(lambda: c.condition("Ready").get("status") == "True", what="Ready")


def test_apply_creates_every_child_with_owner_references(tmp_path):
    async def scenario():
        async with cluster(tmp_path / "kubeconfig") as c, running_operator():
            await c.apply(engine_manifest(ranks=2))
            await eventually(lambda: len(c.pods()) == 2 and _children_exist(c), what="children")
            uid = c.engine()["metadata"]["uid"]
            for path, names in {
                **CHILDREN,
                "v1/pods": {"llama-engine-0", "llama-engine-1"},
            }.items():
                for name in names:
                    refs = c.emu.obj(path, "default", name)["metadata"]["ownerReferences"]
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
            await eventually(lambda: len(events(c, "RankJoined")) == 2, what="join events")
            assert len(events(c, "RankCreated")) == 2

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
            secret = c.emu.obj("v1/secrets", "default", "llama-curve")["data"]
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
    async def scenario():
        async with (
            cluster(tmp_path / "kubeconfig", pod_termination_seconds=0.5) as c,
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
            order = [name for path, _, name in c.emu.delete_requests if path == "v1/pods"]
            assert order == ["llama-engine-3", "llama-engine-2", "llama-engine-1"]
            gone = [p["metadata"] for p in c.emu.deleted if p["kind"] == "Pod"]
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
            assert len(events(c, "RankScaledDown")) == 3

    run(scenario())


def test_spec_change_rolls_ranks_one_at_a_time(tmp_path):
    async def scenario():
        async with cluster(tmp_path / "kubeconfig") as c, running_operator():
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
                await asyncio.sleep(1.5)  # over a timer period: nothing else moves meanwhile
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
            args = c.emu.obj("v1/configmaps", "default", "llama-engine-args")["data"]["args"]
            assert "--max-num-seqs 64" in args
            assert len(events(c, "RankReplaced")) == 3

    run(scenario())


def test_failed_pod_is_replaced(tmp_path):
    async def scenario():
        async with cluster(tmp_path / "kubeconfig") as c, running_operator():
            await _ready_engine(c, 2)
            before = _uids(c)
            await c.set_pod(
                "llama-engine-1",
                {"phase": "Failed", "reason": "Evicted", "message": "The node was low on memory."},
            )
            await eventually(lambda: _uids(c).get(1, before[1]) != before[1], what="new rank 1")
            assert _uids(c)[0] == before[0]
            await eventually(lambda: events(c, "RankFailedReplaced"), what="event")
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


def test_deleting_the_engine_stops_all_work(tmp_path):
    async def scenario():
        async with cluster(tmp_path / "kubeconfig") as c, running_operator() as operator:
            await _ready_engine(c, 2)
            await c.request("DELETE", f"{IE_URL}/llama")
            await eventually(
                lambda: (
                    c.emu.obj("corefleet.dev/v1alpha1/inferenceengines", "default", "llama") is None
                ),
                what="engine gone",
            )
            await eventually(
                lambda: not c.pods() and not c.emu.objs("v1/services"), what="children collected"
            )
            writes = len(c.emu.deleted)
            await asyncio.sleep(2.5)  # two timer periods: nothing comes back
            assert not c.pods() and not c.emu.objs("apps/v1/deployments")
            assert len(c.emu.deleted) == writes
            assert not operator.done()
        assert operator.done() and operator.exception() is None

    run(scenario())


def test_restarted_operator_resumes_and_recreates_a_lost_rank(tmp_path):
    async def scenario():
        async with cluster(tmp_path / "kubeconfig") as c:
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
