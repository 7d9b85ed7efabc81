"""What only the operator can see becomes status: crash loops, no GPUs, bad specs, no volume.

Against a real API server, with the chart's RBAC for `-n default`. The test plays the kubelet
(pod status) and the Deployment controller; the GPU shortage comes from the real scheduler.
"""

from __future__ import annotations

import datetime
from typing import Any

from audit_log import by_user
from chart_install import OPERATOR_USER
from operator_harness import (
    IE_URL,
    engine_manifest,
    eventually,
    printer_columns,
    run,
)
from operator_run import running_operator
from real_cluster import RealCluster, real_cluster


def oom_loop(restarts: int) -> dict[str, Any]:
    """A rank whose engine the kubelet restarts again and again (killed for memory)."""
    return {
        "phase": "Running",
        "conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Ready", "status": "False"},
        ],
        "containerStatuses": [
            {
                "name": "engine",
                "image": "corefleet:test",
                "imageID": "",
                "ready": False,
                "restartCount": restarts,
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


def _status_writes(c: RealCluster) -> int:
    """The operator's writes of the engine's status (accepted or not)."""
    return len(
        c.audit.select("patch", "inferenceengines", by_user(OPERATOR_USER), subresource="status")
    )


def test_crash_looping_rank_keeps_the_engine_not_ready(tmp_path):
    async def scenario():
        async with real_cluster(tmp_path) as c, running_operator() as operator:
            await c.apply(engine_manifest(ranks=2))
            await eventually(lambda: len(c.pods()) == 2, what="pods")
            await c.all_ready()
            await eventually(lambda: c.condition("Ready").get("status") == "True", what="Ready")
            uid = c.pods()[0]["metadata"]["uid"]
            await c.set_pod("llama-engine-0", oom_loop(4))
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
            await eventually(lambda: c.events("RankFailed"), what="warning event")
            assert c.events("RankFailed")[0]["type"] == "Warning"
            # The kubelet restarts it again; the operator reports that (it has seen the pod's
            # latest state), reconciles twice more on its timer, and still does not replace it.
            await c.set_pod("llama-engine-0", oom_loop(5))
            await eventually(lambda: c.status()["ranks"][0].get("restarts") == 5, what="5")
            await operator.log.ticks(2)
            assert c.pods()[0]["metadata"]["uid"] == uid
            assert c.condition("Ready")["status"] == "False"
            assert not c.writes("delete")

    run(scenario())


async def _cpu_only_node(c: RealCluster) -> None:
    """A Ready node with CPUs and memory but no GPU, as its kubelet would register it."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    await c.request("POST", "/api/v1/nodes", {"metadata": {"name": "cpu-only"}})
    # Node admission taints a new node not-ready; the node lifecycle controller would lift it.
    merge = {"Content-Type": "application/merge-patch+json"}
    await c.request("PATCH", "/api/v1/nodes/cpu-only", {"spec": {"taints": None}}, merge)
    size = {"cpu": "4", "memory": "8Gi", "pods": "110"}
    ready = {"type": "Ready", "status": "True", "reason": "KubeletReady"}
    ready |= {"lastHeartbeatTime": now, "lastTransitionTime": now}
    status = {"capacity": size, "allocatable": size, "conditions": [ready]}
    await c.request("PATCH", "/api/v1/nodes/cpu-only/status", {"status": status}, merge)


def test_unschedulable_rank_reports_the_gpu_shortage(tmp_path):
    """The real scheduler finds no node with a GPU and says so in the pod's status."""

    async def scenario():
        async with real_cluster(tmp_path, scheduler=True) as c, running_operator():
            await _cpu_only_node(c)
            await c.apply(engine_manifest(ranks=1))
            await eventually(lambda: 0 in c.pods(), what="pod")
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
    """A spec the CRD's schema and rules accept but the operator cannot run (two GPUs for a
    rank of one worker) is reported in the status, once, and nothing is created."""

    async def scenario():
        async with real_cluster(tmp_path) as c, running_operator() as operator:
            bad = engine_manifest(resources={"limits": {"nvidia.com/gpu": 2}})
            await c.apply(bad)
            await eventually(
                lambda: c.condition("Degraded").get("reason") == "InvalidSpec", what="InvalidSpec"
            )
            assert "nvidia.com/gpu" in c.condition("Degraded")["message"]
            assert c.condition("Ready")["status"] == "False"
            # The timer reconciles it again and again (kopf does not retry the failed create
            # handler): no status write, no child. (The first tick lets the audit log catch up
            # with the write that reported InvalidSpec.)
            await operator.log.ticks(1)
            writes = _status_writes(c)
            await operator.log.ticks(3)
            assert _status_writes(c) == writes
            assert not c.writes("create") and not c.writes("create", "deployments")

            await c.patch_spec({"resources": {"limits": {"nvidia.com/gpu": 1}}})  # fixed
            await eventually(lambda: 0 in c.pods() and 1 in c.pods(), what="pods")
            await eventually(
                lambda: c.condition("Degraded").get("reason") == "AllRanksHealthy", what="healthy"
            )
            assert c.status()["observedGeneration"] == 2

    run(scenario())


def test_missing_model_volume_is_degraded_until_it_exists(tmp_path):
    async def scenario():
        async with real_cluster(tmp_path) as c, running_operator():
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
            claim = {
                "metadata": {"name": "weights"},
                "spec": {
                    "accessModes": ["ReadOnlyMany"],
                    "resources": {"requests": {"storage": "1Gi"}},
                },
            }
            await c.request("POST", "/api/v1/namespaces/default/persistentvolumeclaims", claim)
            await eventually(
                lambda: c.condition("Degraded").get("status") == "False", what="volume found"
            )

    run(scenario())


def test_the_crd_defaults_the_spec_and_serves_the_scale_subresource(tmp_path):
    async def scenario():
        async with real_cluster(tmp_path) as c:
            created = await c.apply(engine_manifest(ranks=3))
            assert created["spec"]["engine"]["maxNumSeqs"] == 256  # CRD defaults applied
            assert created["spec"]["shutdown"] == {"mode": "Drain"}
            scale = await c.request("GET", f"{IE_URL}/llama/scale")
            assert scale["spec"]["replicas"] == 3

    run(scenario())
