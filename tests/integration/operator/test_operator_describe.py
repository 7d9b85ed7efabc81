"""`kubectl describe ie` lists an Event for every rank transition, once each.

The real operator runs against a real API server (a stand-in kubelet binds the pods, so that they
linger while terminating, and ends them 0.3 s after their deletion); the test plays the kubelet's
status and the Deployment controller. It walks an engine through its life:
creation, ranks and coordinator ready, a rank restarting in place, a scale-down, a rolling update,
the coordinator going away. Then the real kubectl describes the engine, and every transition
appears in its Events exactly once (none is repeated by the reconciles in between: the timer, pod
events, status writes): the test lets the operator reconcile twice more on its timer after the
last transition before it counts.
"""

from __future__ import annotations

import asyncio
import collections
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from operator_harness import Cluster, engine_manifest, eventually, run, running_status
from operator_run import running_operator
from real_cluster import real_cluster

KUBECTL = shutil.which("kubectl")


def reasons(c: Cluster) -> collections.Counter[str]:
    """How often each reason was posted about the engine."""
    return collections.Counter(
        e["reason"]
        for e in c.objs("v1/events", "default")
        if e["involvedObject"].get("kind") == "InferenceEngine"
    )


def has(c: Cluster, reason: str, count: int = 1) -> bool:
    """At least `count` Events with this reason exist."""
    return reasons(c)[reason] >= count


def restarted_status() -> dict[str, Any]:
    """A rank whose process died and that the kubelet restarted in place: loading again."""
    status = running_status(False)
    status["containerStatuses"][0].update(
        restartCount=1, lastState={"terminated": {"exitCode": 137, "reason": "OOMKilled"}}
    )
    return status


@pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed")
def test_describe_shows_an_event_per_transition(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with (
            real_cluster(tmp_path, pod_termination_seconds=0.3) as c,
            running_operator() as operator,
        ):
            await c.apply(engine_manifest(ranks=2))
            await eventually(lambda: len(c.pods()) == 2, what="rank pods")
            await c.all_ready()
            await eventually(lambda: has(c, "RankJoined", 2), what="ranks joined")
            await eventually(lambda: has(c, "CoordinatorReady"), what="coordinator ready")

            await c.set_pod("llama-engine-1", restarted_status())
            await eventually(lambda: has(c, "RankNotReady"), what="rank 1 not ready")
            await c.pod_ready("llama-engine-1")
            await eventually(lambda: has(c, "RankJoined", 3), what="rank 1 back")

            await c.scale(1)
            await eventually(lambda: has(c, "RankRemoved"), what="rank 1 removed")

            await c.patch_spec({"engine": {"maxNumSeqs": 128}})
            await eventually(lambda: has(c, "RankReplaced"), what="rank 0 replaced")
            new = await eventually(
                lambda: (
                    [p for p in c.pods().values() if "deletionTimestamp" not in p["metadata"]]
                    and has(c, "RankCreated", 3)
                ),
                what="rank 0 recreated",
            )
            assert new
            await c.pod_ready("llama-engine-0")
            await eventually(lambda: has(c, "RolloutComplete"), what="rollout complete")

            await c.coordinator_available(available=False)
            await eventually(lambda: has(c, "CoordinatorUnavailable"), what="coordinator lost")
            await operator.log.ticks(2)

            done = await asyncio.to_thread(c.api.kubectl, "describe", "ie", "llama")  # as admin
            described, posted = done.stdout, reasons(c)

        assert posted == {
            "RankCreated": 3,  # ranks 0 and 1, then rank 0 of the new spec
            "RankJoined": 4,  # both, rank 1 after its restart, the new rank 0
            "CoordinatorReady": 1,
            "RankNotReady": 1,
            "RankScaledDown": 1,
            "RankDraining": 2,  # rank 1 (scale-down), rank 0 (replaced)
            "RankRemoved": 1,
            "RolloutStarted": 1,
            "RankReplaced": 1,
            "RolloutComplete": 1,
            "CoordinatorUnavailable": 1,
        }
        events = described[described.index("\nEvents:") :]
        rows = [
            r for r in map(str.split, events.splitlines()) if r and r[0] in ("Normal", "Warning")
        ]
        assert collections.Counter(row[1] for row in rows) == posted, events
        not_ready = r"Warning\s+RankNotReady\s+\S+\s+corefleet-operator\s+rank 1 is not ready"
        assert re.search(not_ready, events)
        complete = r"Normal\s+RolloutComplete\s+.*every rank runs the current spec \(1 updated\)"
        assert re.search(complete, events)

    run(scenario(), timeout=180)
