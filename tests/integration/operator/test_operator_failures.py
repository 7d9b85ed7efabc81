"""What only the operator can see becomes status: crash loops, no GPUs, bad specs, no volume."""

from __future__ import annotations

import asyncio

from operator_harness import (
    IE_URL,
    cluster,
    engine_manifest,
    events,
    eventually,
    printer_columns,
    run,
    running_operator,
)

OOM_LOOP = {
    "phase": "Running",
    "conditions": [
        {"type": "PodScheduled", "status": "True"},
        {"type": "Ready", "status": "False"},
    ],
    "containerStatuses": [
        {
            "name": "engine",
            "ready": False,
            "restartCount": 4,
            "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 1m20s"}},
            "lastState": {
                "terminated": {
                    "reason": "OOMKilled",
                    "exitCode": 137,
                    "finishedAt": "2026-01-01T00:00:00Z",
                }
            },
        }
    ],
}
NO_GPU = {
    "phase": "Pending",
    "conditions": [
        {
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
        }
    ],
}


def _status_writes(c) -> int:
    return sum(
        1
        for r in c.emu._requests
        if r.method.value == "PATCH" and r.url.path.endswith("/llama/status")
    )


def test_crash_looping_rank_keeps_the_engine_not_ready(tmp_path):
    async def scenario():
        async with cluster(tmp_path / "kubeconfig") as c, running_operator():
            await c.apply(engine_manifest(ranks=2))
            await eventually(lambda: len(c.pods()) == 2, what="pods")
            await c.all_ready()
            await eventually(lambda: c.condition("Ready").get("status") == "True", what="Ready")
            uid = c.pods()[0]["metadata"]["uid"]
            await c.set_pod("llama-engine-0", OOM_LOOP)
            await eventually(
                lambda: c.condition("Degraded").get("status") == "True", what="Degraded"
            )
            assert c.condition("Degraded")["reason"] == "OOMKilled"
            assert c.condition("Ready")["status"] == "False"
            assert c.condition("Ready")["reason"] == "RankFailed"
            rank0 = c.status()["ranks"][0]
            assert rank0["stage"] == "Failed" and "OOMKilled" in rank0["message"]
            assert rank0["restarts"] == 4
            assert printer_columns(c.engine())["RANKS"] == "1/2"
            await eventually(lambda: events(c, "RankFailed"), what="warning event")
            assert events(c, "RankFailed")[0]["type"] == "Warning"
            await asyncio.sleep(1.5)  # the kubelet restarts it; the operator does not replace it
            assert c.pods()[0]["metadata"]["uid"] == uid
            assert c.condition("Ready")["status"] == "False"

    run(scenario())


def test_unschedulable_rank_reports_the_gpu_shortage(tmp_path):
    async def scenario():
        async with cluster(tmp_path / "kubeconfig") as c, running_operator():
            await c.apply(engine_manifest(ranks=1))
            await eventually(lambda: 0 in c.pods(), what="pod")
            await c.set_pod("llama-engine-0", NO_GPU)
            # The pod is created before the first status is written: poll through "no status".
            await eventually(
                lambda: (c.status().get("ranks") or [{}])[0].get("stage") == "Scheduling",
                what="Scheduling",
            )
            assert "Insufficient nvidia.com/gpu" in c.status()["ranks"][0]["message"]
            progressing = c.condition("Progressing")
            assert (progressing["status"], progressing["reason"]) == ("True", "WaitingForCapacity")
            assert c.condition("Degraded")["status"] == "False"

    run(scenario())


def test_invalid_spec_is_reported_once_and_never_retried(tmp_path):
    async def scenario():
        async with cluster(tmp_path / "kubeconfig") as c, running_operator():
            bad = engine_manifest(shutdown={"mode": "Abort", "drainTimeoutSeconds": 10})
            await c.apply(bad)  # the emulator has no CEL; a real server would refuse this
            await eventually(
                lambda: c.condition("Degraded").get("reason") == "InvalidSpec", what="InvalidSpec"
            )
            assert "drainTimeoutSeconds" in c.condition("Degraded")["message"]
            assert c.condition("Ready")["status"] == "False"
            writes = _status_writes(c)
            await asyncio.sleep(2.5)  # timer ticks and kopf's retry policy: no spinning
            assert _status_writes(c) == writes
            assert not c.pods() and not c.emu.objs("apps/v1/deployments")

            await c.patch_spec({"shutdown": {"mode": "Drain"}})  # fixed: children appear
            await eventually(lambda: 0 in c.pods() and 1 in c.pods(), what="pods")
            await eventually(
                lambda: c.condition("Degraded").get("reason") == "AllRanksHealthy", what="healthy"
            )
            assert c.status()["observedGeneration"] == 2

    run(scenario())


def test_missing_model_volume_is_degraded_until_it_exists(tmp_path):
    async def scenario():
        async with cluster(tmp_path / "kubeconfig") as c, running_operator():
            model = {
                "path": "/models/llama",
                "volume": {"persistentVolumeClaim": {"claimName": "weights"}},
            }
            await c.apply(engine_manifest(ranks=1, model=model))
            await eventually(
                lambda: c.condition("Degraded").get("reason") == "ModelVolumeNotFound",
                what="ModelVolumeNotFound",
            )
            pod = c.pods()[0]["spec"]
            assert {"name": "model", "persistentVolumeClaim": {"claimName": "weights"}} in pod[
                "volumes"
            ]
            await c.request(
                "POST",
                "/api/v1/namespaces/default/persistentvolumeclaims",
                {"metadata": {"name": "weights"}, "spec": {}},
            )
            await eventually(
                lambda: c.condition("Degraded").get("status") == "False",
                what="volume found",
                timeout=5,
            )

    run(scenario())


def test_status_subresource_scale_reads_the_emulated_crd(tmp_path):
    async def scenario():
        async with cluster(tmp_path / "kubeconfig") as c:
            created = await c.apply(engine_manifest(ranks=3))
            assert created["spec"]["engine"]["maxNumSeqs"] == 256  # CRD defaults applied
            assert created["spec"]["shutdown"] == {"mode": "Drain"}
            scale = await c.request("GET", f"{IE_URL}/llama/scale")
            assert scale["spec"]["replicas"] == 3

    run(scenario())
