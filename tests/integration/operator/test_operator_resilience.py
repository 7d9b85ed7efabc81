"""The operator on an unreliable API: watches that end or expire, and conflicting writes.

Every scenario here runs on the emulator: its faults are ones a real API server does not produce
on demand. They come from kmock reactions (declared per test, matched before the emulator serves
a request): refused watches (429), an ended stream, a resume past the history (410 Gone), one
409 Conflict, 429 or 503 on a chosen write. Each test's docstring names its fault. What the
operator did is read back from the emulator's request log, so a duplicate write shows even when
the server refused it.
"""

from __future__ import annotations

import collections
from typing import Any

import kmock
import pytest
from emulated_cluster import EmulatedCluster as Cluster
from emulated_cluster import emulated_cluster as cluster
from operator_harness import engine_manifest, eventually, run
from operator_run import running_operator

CONTROL = "/test-control/end-watches"  # not a Kubernetes path: served by a reaction below


def _requests(c: Cluster, method: str, path: str) -> collections.Counter[str]:
    """How often each object name under a collection URL got a request with this method."""
    names: collections.Counter[str] = collections.Counter()
    for request in list(c.emu._requests):
        url = request.url.path
        if request.method.value.upper() != method or path not in url:
            continue
        if method == "POST":  # the name is in the body
            names[((request.data or {}).get("metadata") or {}).get("name", "?")] += 1
        else:
            names[url.rsplit(path, 1)[1].strip("/").split("/")[0]] += 1
    return names


def _lists(c: Cluster, path: str) -> int:
    """kopf's LIST requests (not watches) of a collection: it lists again after 410 Gone. The
    operator's own lists before a create select by label, kopf's select nothing."""
    return sum(
        1
        for r in list(c.emu._requests)
        if r.method.value.upper() == "GET"
        and r.url.path.endswith(path)
        and r.params.get("watch") not in ("true", "1")
        and "labelSelector" not in r.params
    )


def _watches(c: Cluster, path: str) -> int:
    """How many watch requests of a collection (URL ending in `path`) the operator opened."""
    return sum(
        1
        for r in list(c.emu._requests)
        if r.method.value.upper() == "GET"
        and r.url.path.endswith(path)
        and r.params.get("watch") in ("true", "1")
    )


WATCHED = ("/pods", "/inferenceengines", "/deployments")


async def _cut_watches(c: Cluster) -> None:
    """End every watch stream; return once the operator has watched each resource again."""
    before = {path: _watches(c, path) for path in WATCHED}
    await c.request("GET", CONTROL)
    await eventually(
        lambda: all(_watches(c, path) > n for path, n in before.items()), what="watched again"
    )


def _end_watches_on_request(c: Cluster) -> None:
    """GET CONTROL ends every open watch stream, in the emulator's own event loop."""

    def end(_: Any) -> dict[str, Any]:
        c.emu.close_watches()
        return {}

    c.emu["get", kmock.path(CONTROL)] << end


async def _ready_children(c: Cluster, ranks: int) -> None:
    await eventually(
        lambda: len(c.pods()) == ranks and c.emu.obj("v1/services", "default", "llama-engine"),
        what="children",
    )


def test_ended_and_expired_watches_resume_without_duplicate_children(tmp_path, monkeypatch):
    """Watch streams the server ends, and a resume past the server's history (410 Gone).

    Emulator: the server ends every watch stream on request, refuses watches with 429 for a
    while, and keeps a history of only 20 events (a real one keeps minutes of them).

    While the pod watch is refused (429, as a busy server's priority and fairness does), rank 1's
    pod is deleted and more pod events pass than the emulator keeps, so the watch that resumes
    from its resourceVersion is told 410 Gone and kopf lists the pods again. kopf's index keeps
    the deleted pod (no DELETED event came); the operator's periodic check by a list finds it gone
    (every second here, COREFLEET_OPERATOR_RESYNC_SECONDS) and recreates the rank.
    """
    monkeypatch.setenv("COREFLEET_OPERATOR_RESYNC_SECONDS", "1")

    async def scenario():
        async with cluster(tmp_path / "kubeconfig", history_size=20) as c:
            _end_watches_on_request(c)
            refusing = {"pods": False}
            (
                c.emu[
                    lambda r: (
                        refusing["pods"]
                        and r.params.get("watch") in ("true", "1")
                        and r.url.path.endswith("/pods")
                    )
                ]
                << 429
                << {"kind": "Status", "code": 429, "reason": "TooManyRequests"}
            )
            async with running_operator():
                await c.apply(engine_manifest(ranks=3))
                await _ready_children(c, 3)
                for _ in range(3):  # the server ends every stream; kopf resumes each
                    await _cut_watches(c)
                    await c.coordinator_available()
                await c.all_ready()
                await eventually(lambda: c.status().get("rankSummary") == "3/3", what="3/3")
                assert _requests(c, "POST", "/pods") == {f"llama-engine-{r}": 1 for r in range(3)}

                lists = _lists(c, "/pods")
                refusing["pods"] = True
                await c.request("GET", CONTROL)
                old = c.pods()[1]["metadata"]["uid"]
                await c.request("DELETE", "/api/v1/namespaces/default/pods/llama-engine-1")
                for i in range(25):  # past the emulator's history of 20 events
                    await c.set_pod("llama-engine-0", {"message": f"tick {i}"})
                refusing["pods"] = False
                await eventually(lambda: _lists(c, "/pods") > lists, what="pods listed again")
                await eventually(
                    lambda: 1 in c.pods() and c.pods()[1]["metadata"]["uid"] != old,
                    what="rank 1 recreated after the relist",
                )
                await c.pod_ready("llama-engine-1")
                await eventually(lambda: c.status().get("rankSummary") == "3/3", what="3/3")
            posts = _requests(c, "POST", "/pods")
            assert posts == {"llama-engine-0": 1, "llama-engine-1": 2, "llama-engine-2": 1}
            services = _requests(c, "POST", "/services")
            assert services == {"llama-coordinator": 1, "llama-coordinators": 1, "llama-engine": 1}
            assert _requests(c, "DELETE", "/pods") == {"llama-engine-1": 1}  # the test's own

    run(scenario(), timeout=120)


CONFLICT = {
    "apiVersion": "v1",
    "kind": "Status",
    "status": "Failure",
    "reason": "Conflict",
    "code": 409,
    "message": "Operation cannot be fulfilled: the object has been modified; please apply your "
    "changes to the latest version and try again",
}


async def _coordinator_unavailable(c: Cluster) -> None:
    """The coordinator Deployment loses its available replica: a change no pod event reports."""
    await c.request(
        "PATCH",
        "/apis/apps/v1/namespaces/default/deployments/llama-coordinator/status",
        {"status": {"replicas": 1, "availableReplicas": 0}},
        {"Content-Type": "application/merge-patch+json"},
    )


def _conflict_once(c: Cluster, method: str, path_end: str) -> dict[str, int]:
    """The next `method` request to a URL ending in `path_end` is answered 409 Conflict."""
    return _fail_once(c, method, path_end, 409, CONFLICT)


def _fail_once(
    c: Cluster, method: str, path_end: str, status: int, payload: dict[str, Any]
) -> dict[str, int]:
    """The next `method` request to a URL ending in `path_end` is answered `status`."""
    seen = {"conflicts": 0}

    def answer(_: kmock.Request) -> Any:
        if seen["conflicts"]:
            return NotImplemented  # kmock's "no match": the emulator serves it
        seen["conflicts"] = 1
        return kmock.Response(status=status, payload=payload)

    c.emu[lambda r: r.method.value.upper() == method and r.url.path.endswith(path_end)] << answer
    return seen


def test_conflicting_status_write_is_retried_with_the_current_state(tmp_path):
    """One 409 on the status subresource: the operator writes the status again, and what it
    writes is the state at the retry (both ranks Ready), not the one it computed before.

    Emulator: the 409 is forced on one chosen write; a real server's conflicts depend on timing."""

    async def scenario():
        async with cluster(tmp_path / "kubeconfig") as c:
            seen = _conflict_once(c, "PATCH", "/inferenceengines/llama/status")
            async with running_operator():
                await c.apply(engine_manifest(ranks=2))
                await _ready_children(c, 2)
                await eventually(lambda: seen["conflicts"], what="the 409")
                await c.all_ready()
                await eventually(lambda: c.status().get("rankSummary") == "2/2", what="2/2")
                assert c.condition("Ready")["status"] == "True"
                assert [r["stage"] for r in c.status()["ranks"]] == ["Ready", "Ready"]
                assert c.status()["observedGeneration"] == 1
            assert _requests(c, "POST", "/pods") == {"llama-engine-0": 1, "llama-engine-1": 1}

    run(scenario())


def test_conflicting_child_update_is_retried_until_the_child_matches_the_spec(tmp_path):
    """One 409 on the engine ConfigMap's update after a spec change: it is patched again, and the
    rollout that follows still replaces each rank exactly once.

    Emulator: a merge patch without a resourceVersion never conflicts on a real server; the 409
    is forced."""

    async def scenario():
        async with cluster(tmp_path / "kubeconfig", pod_termination_seconds=0.3) as c:
            seen = _conflict_once(c, "PATCH", "/configmaps/llama-engine-args")
            async with running_operator():
                await c.apply(engine_manifest(ranks=2))
                await _ready_children(c, 2)
                await c.all_ready()
                await eventually(lambda: c.status().get("rankSummary") == "2/2", what="2/2")
                await c.patch_spec({"engine": {"maxNumSeqs": 64}})
                await eventually(lambda: seen["conflicts"], what="the 409")

                def args() -> str:
                    obj = c.emu.obj("v1/configmaps", "default", "llama-engine-args") or {}
                    return str((obj.get("data") or {}).get("args"))

                await eventually(lambda: "--max-num-seqs 64" in args(), what="ConfigMap updated")
                for rank in (1, 0):
                    await eventually(
                        lambda r=rank: (
                            r in c.pods()
                            and c.pods()[r]["metadata"]["generation"] == 1
                            and _requests(c, "POST", "/pods")[f"llama-engine-{r}"] == 2
                        ),
                        what=f"rank {rank} replaced",
                    )
                    await c.pod_ready(f"llama-engine-{rank}")
                await eventually(
                    lambda: c.condition("Progressing").get("reason") == "Complete", what="rolled"
                )
            assert _requests(c, "PATCH", "/configmaps")["llama-engine-args"] == 2
            assert _requests(c, "DELETE", "/pods") == {"llama-engine-0": 1, "llama-engine-1": 1}
            assert _requests(c, "POST", "/pods") == {"llama-engine-0": 2, "llama-engine-1": 2}

    run(scenario(), timeout=90)


def test_conflict_seen_only_by_the_timer_is_retried_soon(tmp_path):
    """A change no pod event reports (the coordinator lost its pod) reaches the status through
    the timer; one 409 on that write is retried within the timer's period (1 s here), not after
    kopf's default back-off for a failed handler (60 s).

    Emulator: the 409 is forced on the timer's status write."""

    async def scenario():
        async with cluster(tmp_path / "kubeconfig") as c, running_operator():
            await c.apply(engine_manifest(ranks=1))
            await _ready_children(c, 1)
            await c.all_ready()
            await eventually(lambda: c.condition("Ready").get("status") == "True", what="Ready")
            seen = _conflict_once(c, "PATCH", "/inferenceengines/llama/status")
            await _coordinator_unavailable(c)
            await eventually(lambda: seen["conflicts"], what="the 409")
            await eventually(
                lambda: c.condition("Ready").get("reason") == "CoordinatorUnavailable",
                what="the status written after the conflict",
            )

    run(scenario())


@pytest.mark.parametrize(
    ("code", "reason", "message"),
    [
        (429, "TooManyRequests", "Too many requests, please try again later."),
        (503, "ServiceUnavailable", "the server is currently unable to handle the request"),
    ],
)
def test_an_overloaded_or_failing_api_seen_only_by_the_timer_is_retried_soon(
    tmp_path, code, reason, message
):
    """As with a 409 above, but the API itself failed (429 from API Priority and Fairness, a 503
    while it restarts): the timer's status write is retried in seconds (TRANSIENT_RETRY), not
    after kopf's default back-off (60 s).

    Emulator: a real server answers 429 or 503 only when overloaded or restarting."""

    async def scenario():
        async with cluster(tmp_path / "kubeconfig") as c, running_operator():
            await c.apply(engine_manifest(ranks=1))
            await _ready_children(c, 1)
            await c.all_ready()
            await eventually(lambda: c.condition("Ready").get("status") == "True", what="Ready")
            failure = {"apiVersion": "v1", "kind": "Status", "status": "Failure"}
            failure |= {"code": code, "reason": reason, "message": message}
            seen = _fail_once(c, "PATCH", "/inferenceengines/llama/status", code, failure)
            await _coordinator_unavailable(c)
            await eventually(lambda: seen["conflicts"], what=f"the {code}")
            await eventually(
                lambda: c.condition("Ready").get("reason") == "CoordinatorUnavailable",
                timeout=30,
                what="the status written after the failure",
            )

    run(scenario(), timeout=90)
