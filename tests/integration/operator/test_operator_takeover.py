"""`corefleet-operator` processes killed with SIGKILL: a restart mid-operation, a leader's death.

Each process logs in with a kubeconfig of its own whose token names it, so the emulator's request
log tells which process made each request. Pod creations and deletions are counted per pod name
from that log: a restarted operator that repeats a write shows even when the server refused it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import kmock
import yaml
from operator_harness import REPO, Cluster, cluster, engine_manifest, eventually, run

PEERING = [
    d
    for d in yaml.safe_load_all((REPO / "crds" / "kopf-peering.yaml").read_text())
    if d and d["kind"] == "CustomResourceDefinition"
]


def _kubeconfig(tmp_path: pathlib.Path, token: str) -> pathlib.Path:
    config = yaml.safe_load((tmp_path / "kubeconfig").read_text())
    config["users"][0]["user"]["token"] = token
    path = tmp_path / f"kubeconfig-{token}"
    path.write_text(yaml.safe_dump(config))
    return path


@contextlib.asynccontextmanager
async def _operator(tmp_path: pathlib.Path, token: str, *args: str) -> AsyncIterator[Any]:
    """A `corefleet-operator` process; SIGKILLed on the way out if it still runs."""
    command = [
        sys.executable,
        "-c",
        "from corefleet.operator.cli import cli; cli()",
        "--liveness",
        "",
    ]
    env = {**os.environ, "KUBECONFIG": str(_kubeconfig(tmp_path, token))}
    log = (tmp_path / f"operator-{token}.log").open("w")
    proc = subprocess.Popen([*command, *args], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        await asyncio.to_thread(proc.wait, 30)
        log.close()


def _by(token: str) -> Callable[[kmock.Request], bool]:
    return lambda r: r.headers.get("Authorization", "") == f"Bearer {token}"


def _writes(c: Cluster, method: str, who: Callable[[kmock.Request], bool] | None = None):
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


def _event_posts(c: Cluster, who: Callable[[kmock.Request], bool], reason: str) -> list[str]:
    """The messages of the Events with `reason` that `who` POSTed (accepted or not)."""
    return [
        str((r.data or {}).get("message"))
        for r in list(c.emu._requests)
        if r.method.value.upper() == "POST"
        and r.url.path.endswith("/events")
        and who(r)
        and (r.data or {}).get("reason") == reason
    ]


async def _ready(c: Cluster, ranks: int) -> None:
    await eventually(lambda: len(c.pods()) == ranks, timeout=30, what=f"{ranks} pods")
    await c.all_ready()
    await eventually(
        lambda: c.status().get("rankSummary") == f"{ranks}/{ranks}", timeout=30, what="ready"
    )


def _slow_delete(c: Cluster, pod: str, seconds: float) -> dict[str, int]:
    """The DELETE of `pod` is held `seconds` before the emulator serves it (a slow server)."""
    seen = {"held": 0}

    async def hold(_: kmock.Request) -> Any:
        seen["held"] += 1
        await asyncio.sleep(seconds)
        return NotImplemented  # kmock's "no match": the emulator serves it now

    (
        c.emu[lambda r: r.method.value.upper() == "DELETE" and r.url.path.endswith(f"/pods/{pod}")]
        << hold
    )
    return seen


def test_operator_killed_mid_scale_down_finishes_it_deleting_each_pod_once(tmp_path):
    """Scale 4 -> 1, the operator SIGKILLed while rank 2's DELETE is held by the server (the
    server drops it with the connection: rank 2 was never deleted). The new process deletes
    ranks 2 and 1 and leaves rank 3 alone: it still drains (10 s), from the first DELETE."""

    async def scenario():
        async with cluster(tmp_path / "kubeconfig", pod_termination_seconds=10) as c:
            async with _operator(tmp_path, "first", "-n", "default", "--standalone"):
                await c.apply(engine_manifest(ranks=4))
                await _ready(c, 4)
                held = _slow_delete(c, "llama-engine-2", 1.0)
                await c.scale(1)
                await eventually(lambda: held["held"], timeout=30, what="rank 2's DELETE sent")
            first = _writes(c, "DELETE", _by("first"))
            assert first == {"llama-engine-3": 1, "llama-engine-2": 1}
            assert [n for p, _, n in c.emu.delete_requests if p == "v1/pods"] == ["llama-engine-3"]
            async with _operator(tmp_path, "second", "-n", "default", "--standalone"):
                await eventually(lambda: sorted(c.pods()) == [0], timeout=30, what="scaled to 1")
                await eventually(
                    lambda: c.condition("Progressing").get("reason") == "Complete",
                    timeout=30,
                    what="status at 1",
                )
            assert _writes(c, "DELETE", _by("second")) == {"llama-engine-2": 1, "llama-engine-1": 1}
            served = [n for p, _, n in c.emu.delete_requests if p == "v1/pods"]
            assert served == ["llama-engine-3", "llama-engine-2", "llama-engine-1"]
            assert _writes(c, "POST") == {f"llama-engine-{r}": 1 for r in range(4)}

    run(scenario(), timeout=150)


def test_operator_killed_mid_rolling_update_finishes_it_replacing_each_pod_once(tmp_path):
    async def scenario():
        async with cluster(tmp_path / "kubeconfig", pod_termination_seconds=2) as c:
            async with _operator(tmp_path, "first", "-n", "default", "--standalone"):
                await c.apply(engine_manifest(ranks=3))
                await _ready(c, 3)
                await c.patch_spec({"engine": {"maxNumSeqs": 64}})
                # rank 2 is deleted first; killed while its old pod drains
                await eventually(
                    lambda: _writes(c, "DELETE") == {"llama-engine-2": 1}, timeout=30, what="rank 2"
                )
            async with _operator(tmp_path, "second", "-n", "default", "--standalone"):
                for rank in (2, 1, 0):
                    await eventually(
                        lambda r=rank: (
                            _writes(c, "POST")[f"llama-engine-{r}"] == 2 and r in c.pods()
                        ),
                        timeout=30,
                        what=f"rank {rank} recreated",
                    )
                    await c.pod_ready(f"llama-engine-{rank}")
                await eventually(
                    lambda: c.condition("Progressing").get("reason") == "Complete",
                    timeout=30,
                    what="rollout done",
                )
            assert _writes(c, "DELETE") == {f"llama-engine-{r}": 1 for r in range(3)}
            assert _writes(c, "POST") == {f"llama-engine-{r}": 2 for r in range(3)}

    run(scenario(), timeout=150)


def test_only_the_leader_acts_and_the_other_takes_over_within_30s(tmp_path):
    async def scenario():
        async with cluster(tmp_path / "kubeconfig") as c:
            for crd in PEERING:
                await c.request(
                    "POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd
                )
            await c.request(
                "POST",
                "/apis/kopf.dev/v1/clusterkopfpeerings",
                {
                    "apiVersion": "kopf.dev/v1",
                    "kind": "ClusterKopfPeering",
                    "metadata": {"name": "corefleet-operator"},
                },
            )

            def peers() -> dict[str, Any]:
                obj = c.emu.obj("kopf.dev/v1/clusterkopfpeerings", "", "corefleet-operator")
                return (obj or {}).get("status") or {}

            async with (
                _operator(tmp_path, "leader", "-A", "--priority", "20") as leader,
                _operator(tmp_path, "follower", "-A", "--priority", "10"),
            ):
                await eventually(lambda: len(peers()) == 2, timeout=30, what="both peers listed")
                await c.apply(engine_manifest(ranks=2))
                await _ready(c, 2)
                await asyncio.sleep(2)  # a few timer periods: the follower would have acted
                assert not _writes(c, "POST", _by("follower"))
                assert not [
                    r
                    for r in list(c.emu._requests)
                    if _by("follower")(r)
                    and r.method.value.upper() != "GET"
                    and "kopf.dev" not in r.url.path
                ], "the follower wrote something other than its peering entry"

                uids = {r: p["metadata"]["uid"] for r, p in c.pods().items()}
                leader.send_signal(signal.SIGKILL)
                killed = time.monotonic()
                await asyncio.to_thread(leader.wait, 10)
                await c.scale(3)
                await eventually(
                    lambda: 2 in c.pods(), timeout=30, what="rank 2 created by the follower"
                )
                assert time.monotonic() - killed < 30
                # Only rank 2: the follower's indexes were empty when it resumed (kopf does not
                # watch while paused), and it must not take that for "ranks 0 and 1 are missing".
                assert _writes(c, "POST", _by("follower")) == {"llama-engine-2": 1}
                assert {r: c.pods()[r]["metadata"]["uid"] for r in (0, 1)} == uids
                # and one RankCreated Event for it (kopf posts Events in the background)
                await eventually(
                    lambda: _event_posts(c, _by("follower"), "RankCreated"),
                    timeout=30,
                    what="the follower's RankCreated Event",
                )
                await c.pod_ready("llama-engine-2")
                await eventually(
                    lambda: c.status().get("rankSummary") == "3/3", timeout=30, what="3/3 ready"
                )
                assert _event_posts(c, _by("follower"), "RankCreated") == ["rank 2 created"]

    run(scenario(), timeout=150)
