"""`corefleet-operator` processes killed with SIGKILL: a restart mid-operation, a leader's death.

Each process logs in with a kubeconfig of its own. On the real API server every one is a token
of the chart's ServiceAccount, and the audit log tells them apart by the token's id
(`audit_log.by_credential`); pod creations and deletions are counted per pod name from that log,
so a restarted operator that repeats a write shows even when the server refused it. The one
scenario that needs a request held by the server runs on the emulator, whose request log names
the process by its token.
"""

from __future__ import annotations

import asyncio
import collections
import pathlib
import signal
import subprocess
import threading
from collections.abc import Callable
from typing import Any

import kmock
from audit_log import WRITES, Entry, by_credential, ref
from chart_install import CLUSTER_WIDE_PEERED
from emulated_cluster import EmulatedCluster, emulated_cluster, write_kubeconfig
from operator_harness import Cluster, engine_manifest, eventually, run
from operator_run import ProcessLog, lines_with, operator_process
from real_cluster import RealCluster, real_cluster

PEERINGS = "kopf.dev/v1/clusterkopfpeerings"
NAMESPACED = ("-n", "default", "--standalone")


async def _ready(c: Cluster, ranks: int) -> None:
    await eventually(lambda: len(c.pods()) == ranks, what=f"{ranks} pods")
    await c.all_ready()
    await eventually(lambda: c.status().get("rankSummary") == f"{ranks}/{ranks}", what="ready")


# --- on the emulator: a DELETE the server holds


def _by(token: str) -> Callable[[kmock.Request], bool]:
    return lambda r: r.headers.get("Authorization", "") == f"Bearer {token}"


def _emulated_writes(
    c: EmulatedCluster, method: str, who: Callable[[kmock.Request], bool] | None = None
) -> collections.Counter[str]:
    """How often each pod got a POST (by body name) or DELETE (by URL) from `who`."""
    names: collections.Counter[str] = collections.Counter()
    for r in list(c.emu._requests):
        if r.method.value.upper() != method or "/pods" not in r.url.path:
            continue
        if who is not None and not who(r):
            continue
        if method == "POST":
            names[((r.data or {}).get("metadata") or {}).get("name", "?")] += 1
        elif r.url.path.rsplit("/pods/", 1)[-1].count("/") == 0 and "/pods/" in r.url.path:
            names[r.url.path.rsplit("/pods/", 1)[-1]] += 1
    return names


def _held_delete(c: EmulatedCluster, pod: str) -> tuple[dict[str, int], threading.Event]:
    """The first DELETE of `pod` is held by the server until the returned event is set, then
    dropped unserved (answered 503 to a client that is gone); later ones are served."""
    seen, release = {"held": 0}, threading.Event()

    async def hold(_: kmock.Request) -> Any:
        seen["held"] += 1
        if seen["held"] > 1:
            return NotImplemented  # kmock's "no match": the emulator serves it
        for _ in range(1200):  # at most a minute
            if release.is_set():
                break
            await asyncio.sleep(0.05)
        return kmock.Response(status=503, payload={"kind": "Status", "code": 503})

    (
        c.emu[lambda r: r.method.value.upper() == "DELETE" and r.url.path.endswith(f"/pods/{pod}")]
        << hold
    )
    return seen, release


def _emulated_operator(c: EmulatedCluster, tmp_path: pathlib.Path, token: str):
    config = write_kubeconfig(tmp_path / f"kubeconfig-{token}", c.url, token)
    return operator_process(config, tmp_path / f"operator-{token}.log", *NAMESPACED)


def test_operator_killed_mid_scale_down_finishes_it_deleting_each_pod_once(tmp_path):
    """Scale 4 -> 1, the operator SIGKILLed while rank 2's DELETE is held by the server (the
    server drops it with the connection: rank 2 was never deleted). The new process deletes
    ranks 2 and 1 and leaves rank 3 alone: it still drains (10 s), from the first DELETE.

    Emulator: the fault is a request the server holds until the client is gone, then drops; a
    real server cannot be made to hold one chosen request."""

    async def scenario():
        async with emulated_cluster(tmp_path / "kubeconfig", pod_termination_seconds=10) as c:
            async with _emulated_operator(c, tmp_path, "first"):
                await c.apply(engine_manifest(ranks=4))
                await _ready(c, 4)
                held, release = _held_delete(c, "llama-engine-2")
                await c.scale(1)
                await eventually(lambda: held["held"], what="rank 2's DELETE sent")
            release.set()  # the operator is gone: the server drops its request
            first = _emulated_writes(c, "DELETE", _by("first"))
            assert first == {"llama-engine-3": 1, "llama-engine-2": 1}
            assert [n for p, _, n in c.emu.delete_requests if p == "v1/pods"] == ["llama-engine-3"]
            async with _emulated_operator(c, tmp_path, "second"):
                await eventually(lambda: sorted(c.pods()) == [0], what="scaled to 1")
                await eventually(
                    lambda: c.condition("Progressing").get("reason") == "Complete",
                    what="status at 1",
                )
            second = _emulated_writes(c, "DELETE", _by("second"))
            assert second == {"llama-engine-2": 1, "llama-engine-1": 1}
            served = [n for p, _, n in c.emu.delete_requests if p == "v1/pods"]
            assert served == ["llama-engine-3", "llama-engine-2", "llama-engine-1"]
            assert _emulated_writes(c, "POST") == {f"llama-engine-{r}": 1 for r in range(4)}

    run(scenario(), timeout=150)


# --- on the real server


def test_operator_killed_mid_rolling_update_finishes_it_replacing_each_pod_once(tmp_path):
    async def scenario():
        async with real_cluster(tmp_path, pod_termination_seconds=2) as c:
            config, _ = c.operator_kubeconfig("first")
            async with operator_process(config, tmp_path / "first.log", *NAMESPACED):
                await c.apply(engine_manifest(ranks=3))
                await _ready(c, 3)
                await c.patch_spec({"engine": {"maxNumSeqs": 64}})
                # rank 2 is deleted first; killed while its old pod drains
                await eventually(lambda: c.writes("delete") == {"llama-engine-2": 1}, what="rank 2")
            config, _ = c.operator_kubeconfig("second")
            async with operator_process(config, tmp_path / "second.log", *NAMESPACED):
                for rank in (2, 1, 0):
                    await eventually(
                        lambda r=rank: (
                            c.writes("create").get(f"llama-engine-{r}") == 2 and r in c.pods()
                        ),
                        what=f"rank {rank} recreated",
                    )
                    await c.pod_ready(f"llama-engine-{rank}")
                await eventually(
                    lambda: c.condition("Progressing").get("reason") == "Complete",
                    what="rollout done",
                )
            await eventually(
                lambda: (
                    c.writes("delete") == {f"llama-engine-{r}": 1 for r in range(3)}
                    and c.writes("create") == {f"llama-engine-{r}": 2 for r in range(3)}
                ),
                what="one delete and two creates of each pod in the audit log",
            )

    run(scenario(), timeout=180)


def test_only_the_leader_acts_and_the_other_takes_over_when_it_dies(tmp_path):
    """Two replicas peer cluster-wide; the follower pauses for the leader and writes nothing but
    its peering entry. SIGKILLed, the leader says no goodbye: once its entry is older than the
    peering lifetime (20 s), the follower resumes and serves a scale-up, creating only the new
    rank (its indexes were empty when it resumed: kopf does not watch while paused)."""

    async def scenario():
        async with real_cluster(tmp_path, values=CLUSTER_WIDE_PEERED) as c:
            await c.install_peering_crds()
            peering = {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering"}
            peering["metadata"] = {"name": "corefleet-operator"}
            await c.request("POST", "/apis/kopf.dev/v1/clusterkopfpeerings", peering)

            def peers() -> dict[str, Any]:
                return (c.obj(PEERINGS, "", "corefleet-operator") or {}).get("status") or {}

            leader_config, _ = c.operator_kubeconfig("leader")
            follower_config, follower = c.operator_kubeconfig("follower")
            by_follower = by_credential(follower)
            # The leader first: the follower then sees a live higher-priority peer from its
            # first look at the peering, and never resumes (kopf starts paused until it looks).
            leader_args = ("-A", "--priority", "20")
            follower_args = ("-A", "--priority", "10")
            async with operator_process(leader_config, tmp_path / "leader.log", *leader_args) as (
                leader,
                leader_log,
            ):
                await eventually(lambda: len(peers()) == 1, what="the leader listed")
                async with operator_process(
                    follower_config, tmp_path / "follower.log", *follower_args
                ) as (_, follower_log):
                    await eventually(lambda: len(peers()) == 2, what="both peers listed")
                    await _lead_then_take_over(c, leader, leader_log, follower_log, by_follower)

    run(scenario(), timeout=240)


async def _lead_then_take_over(
    c: RealCluster,
    leader: subprocess.Popen[bytes],
    leader_log: ProcessLog,
    follower_log: ProcessLog,
    by_follower: Callable[[Entry], bool],
) -> None:
    """The leader serves an engine alone; killed, the follower takes over."""
    await c.apply(engine_manifest(ranks=2))
    await _ready(c, 2)
    await leader_log.ticks(2)  # the leader has reconciled the ready engine since
    assert not lines_with(follower_log, "Resuming operations")  # paused throughout
    follower_writes = [
        f"{e['verb']} {e['requestURI']}"
        for e in c.audit.select(user=by_follower, subresource=None)
        if e["verb"] in WRITES and ref(e).get("resource") != "clusterkopfpeerings"
    ]
    assert not follower_writes, "the follower wrote other than its peering entry"

    uids = {r: p["metadata"]["uid"] for r, p in c.pods().items()}
    leader.send_signal(signal.SIGKILL)
    await asyncio.to_thread(leader.wait, 10)
    await c.scale(3)
    await eventually(lambda: 2 in c.pods(), timeout=120, what="rank 2 created by the follower")
    assert lines_with(follower_log, "Resuming operations after the pause")
    # Only rank 2: an empty index is not "ranks 0 and 1 are missing". (The server writes a
    # request's audit entry as it answers: a moment after the pod shows.)
    await eventually(
        lambda: c.writes("create", user=by_follower) == {"llama-engine-2": 1},
        what="the follower's one create in the audit log",
    )
    assert {r: c.pods()[r]["metadata"]["uid"] for r in (0, 1)} == uids
    await c.pod_ready("llama-engine-2")
    await eventually(lambda: c.status().get("rankSummary") == "3/3", what="3/3")
    # One RankCreated Event per rank: none repeated for ranks 0 and 1 by the follower
    # (kopf posts Events in the background).
    await eventually(lambda: len(c.events("RankCreated")) == 3, what="rank 2's RankCreated Event")
    messages = sorted(e["message"] for e in c.events("RankCreated"))
    assert messages == [f"rank {r} created" for r in range(3)]
