"""The whole system on one machine: `kubectl apply` of the CPU example to a served fleet, then
scale-down under load, scale-up, rank loss, a rolling update, Abort mode and deletion.

One cluster for the module and one InferenceEngine through all the steps, in order (each step
starts from where the previous one left the fleet, as an operator's day would): every pod runs
from the engine image under runc (the kubelet's container mode, `make images`), ranks load the
real SmolLM2 in their own network namespaces and find the coordinator by its Service name.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from cluster import REPO, LocalCluster, wait_for
from fleet_support import StatusRecorder, StreamingLoad, admin_engines, counter
from images_support import require_images
from netns import can_create_namespaces

_why_not = can_create_namespaces()
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.skipif(_why_not is not None, reason=str(_why_not)),
]

NAME, MODEL = "smollm2", "SmolLM2-135M-Instruct"
EXAMPLE = REPO / "examples" / "smollm2-cpu.yaml"
READY_TIMEOUT = 240.0  # two ranks loading SmolLM2 on a busy 2-core machine


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    require_images()  # the pods run from them
    with LocalCluster(tmp_path_factory.mktemp("cluster"), containers=True) as local:
        yield local
        assert local.kubelet is not None
        assert not local.kubelet.errors, local.kubelet.errors


def _engine(cluster: LocalCluster) -> dict[str, Any]:
    return json.loads(cluster.kubectl("get", "ie", NAME, "-o", "json"))  # type: ignore[no-any-return]


def _get_ie_row(cluster: LocalCluster) -> dict[str, str]:
    lines = cluster.kubectl("get", "ie", NAME).strip().splitlines()
    header, row = lines[0].split(), lines[1].split()
    return dict(zip(header, row, strict=False))


def _fleet_ready(cluster: LocalCluster, ranks: int) -> bool:
    row = _get_ie_row(cluster)
    return row.get("RANKS") == f"{ranks}/{ranks}" and row.get("READY") == "True"


def _wait_ready(cluster: LocalCluster, ranks: int, timeout: float = READY_TIMEOUT) -> None:
    try:
        wait_for(lambda: _fleet_ready(cluster, ranks), timeout, f"RANKS {ranks}/{ranks}", 1.0)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{cluster.logs()}") from None


def _coordinator_url(cluster: LocalCluster) -> str:
    # One coordinator (the example's replicas: 1). A spec change that touches its command rolls
    # it with a surge: the old pod goes once the new one is Ready, so wait for that.
    def the_one() -> dict[str, Any] | None:
        pods = json.loads(
            cluster.kubectl(
                "get", "pods", "-l", "app.kubernetes.io/component=coordinator", "-o", "json"
            )
        )["items"]
        live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        ready = [
            c.get("status") == "True"
            for p in live
            for c in (p.get("status") or {}).get("conditions") or ()
            if c.get("type") == "Ready"
        ]
        return live[0] if len(pods) == 1 and ready == [True] else None

    pod = wait_for(the_one, READY_TIMEOUT, "one Ready coordinator pod", 0.5)
    return f"http://{pod['status']['podIP']}:8000"


def _rank_pod(cluster: LocalCluster, rank: int) -> dict[str, Any] | None:
    assert cluster.kubelet is not None
    obj = cluster.api.obj("v1/pods", "default", f"{NAME}-engine-{rank}")
    return obj


def _steps(base: str) -> dict[int, int]:
    return {e["rank"]: (e.get("stats") or {}).get("steps", 0) for e in admin_engines(base)}


def test_apply_example_gives_a_working_endpoint(cluster: LocalCluster) -> None:
    cluster.kubectl("apply", "-f", str(EXAMPLE))
    _wait_ready(cluster, 2)
    ips = {(_rank_pod(cluster, r) or {}).get("status", {}).get("podIP") for r in (0, 1)}
    assert len(ips) == 2 and None not in ips, "each rank runs in its own namespace and address"
    base = _coordinator_url(cluster)
    assert base.split("//")[1].split(":")[0] not in ips
    joined = admin_engines(base)
    assert sorted(e["rank"] for e in joined) == [0, 1]
    assert {e["pod_name"] for e in joined} == {f"{NAME}-engine-0", f"{NAME}-engine-1"}

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24,
        temperature=0.0,
    )
    from corefleet.engine import LLM, SamplingParams

    offline = LLM(multiprocess=False).chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(max_tokens=24, temperature=0.0),
    )
    assert reply.choices[0].message.content == offline[0].outputs[0].text
    assert "Paris" in (reply.choices[0].message.content or "")
    assert reply.model == MODEL


def test_scale_down_under_load_drains_with_zero_failures(cluster: LocalCluster) -> None:
    base = _coordinator_url(cluster)
    # Six clients of long requests keep each rank busy without gaps: with short ones (48 tokens,
    # a couple of seconds), rank 1 could finish its last request between the check below and
    # the SIGTERM, and drain nothing (CI saw it with three clients, then with six).
    load = StreamingLoad(f"{base}/v1", MODEL, clients=6, max_tokens=256, ignore_eos=True)
    with StatusRecorder(cluster, NAME) as status, load:
        load.wait_completed(3, 120)
        wait_for(lambda: _running(base).get(1, 0) > 0, 60, "requests running on rank 1")
        cluster.kubectl("scale", f"ie/{NAME}", "--replicas=1")
        wait_for(lambda: _rank_pod(cluster, 1) is None, 120, "rank 1's pod to go")
        done = len(load.outcomes)
        load.wait_completed(done + 3, 120)  # rank 0 alone keeps serving
    assert not load.failures(), load.failures()
    assert len(load.outcomes) >= 6
    assert "Draining" in status.stages(1), status.stages(1)
    assert status.stages(1)[-1] == "gone"
    states = {e["rank"]: e["state"] for e in admin_engines(base)}
    assert states[0] == "ready" and states.get(1, "dead") == "dead", states
    log = cluster.kubelet.log("default", f"{NAME}-engine-1") if cluster.kubelet else ""
    drained = re.search(r"rank 1: draining (\d+) request", log)
    assert drained and int(drained.group(1)) >= 1, log[-2000:]  # it held work when told to stop
    assert "rank 1: shut down" in log, log[-2000:]  # and exited by itself, not by SIGKILL
    _wait_ready(cluster, 1)


def test_scale_up_new_rank_joins_and_takes_traffic(cluster: LocalCluster) -> None:
    base = _coordinator_url(cluster)
    cluster.kubectl("scale", f"ie/{NAME}", "--replicas=2")
    _wait_ready(cluster, 2)
    before = _steps(base)
    with StreamingLoad(f"{base}/v1", MODEL, clients=4) as load:
        load.wait_completed(8, 180)
    assert not load.failures(), load.failures()
    wait_for(lambda: _steps(base).get(1, 0) > before.get(1, 0), 10, "rank 1 to step")


def test_rank_loss_recovers(cluster: LocalCluster) -> None:
    assert cluster.kubelet is not None
    base = _coordinator_url(cluster)
    worker = cluster.kubelet.worker("default", f"{NAME}-engine-1")
    assert worker is not None and worker.pid is not None
    with (
        StatusRecorder(cluster, NAME) as status,
        StreamingLoad(f"{base}/v1", MODEL, clients=4) as load,
    ):
        load.wait_completed(2, 120)
        wait_for(lambda: _running(base).get(1, 0) > 0, 60, "requests running on rank 1")
        in_flight_from = time.monotonic()
        os.kill(worker.pid, signal.SIGKILL)
        load.wait_completed(len(load.outcomes) + 4, 120)
        _wait_ready(cluster, 2)
        back = time.monotonic()
    # Streams open on the lost rank either migrate and finish, or end with an error: none of
    # them waits for the rank's restart (a reload of the model, seconds after the kill).
    for outcome in load.failures():
        assert in_flight_from <= outcome.ended < back, outcome
    pod = _rank_pod(cluster, 1)
    assert pod is not None
    assert pod["status"]["containerStatuses"][0]["restartCount"] >= 1
    degraded = list(status.conditions("Degraded"))
    assert ("True", "RankRestarted") in degraded, degraded
    assert degraded[-1][0] == "False", degraded
    assert list(status.conditions("Ready"))[-1] == ("True", "AllRanksReady")
    assert {e["rank"]: e["state"] for e in admin_engines(base)} == {0: "ready", 1: "ready"}


def test_changing_max_num_seqs_rolls_ranks_one_by_one(cluster: LocalCluster) -> None:
    base = _coordinator_url(cluster)
    patch = json.dumps({"spec": {"engine": {"maxNumSeqs": 16}}})
    with StatusRecorder(cluster, NAME) as status, StreamingLoad(f"{base}/v1", MODEL) as load:
        load.wait_completed(2, 120)
        cluster.kubectl("patch", "ie", NAME, "--type", "merge", "-p", patch)
        wait_for(
            lambda: all("16" in _args(_rank_pod(cluster, r)) for r in (0, 1)),
            2 * READY_TIMEOUT,
            "both ranks to run --max-num-seqs 16",
            1.0,
        )
        _wait_ready(cluster, 2)
        load.wait_completed(len(load.outcomes) + 2, 120)
    assert not load.failures(), load.failures()
    for sample in status.samples:  # never both ranks down at once
        down = [r for r in sample.get("ranks") or () if r.get("stage") != "Ready"]
        assert len(down) <= 1, sample


def _args(pod: dict[str, Any] | None) -> str:
    if pod is None or pod["metadata"].get("deletionTimestamp"):
        return ""
    args = pod["spec"]["containers"][0]["args"]
    return str(args[args.index("--max-num-seqs") + 1])


def test_abort_mode_scale_down_aborts_in_flight_at_once(cluster: LocalCluster) -> None:
    cluster.kubectl(
        "patch",
        "ie",
        NAME,
        "--type",
        "merge",
        "-p",
        # drainTimeoutSeconds belongs to Drain (the CRD's CEL rule): remove it with the switch
        json.dumps({"spec": {"shutdown": {"mode": "Abort", "drainTimeoutSeconds": None}}}),
    )
    wait_for(
        lambda: all(
            "abort"
            in " ".join(
                ((_rank_pod(cluster, r) or {}).get("spec") or {})
                .get("containers", [{}])[0]
                .get("args", [])
            )
            for r in (0, 1)
        ),
        2 * READY_TIMEOUT,
        "both ranks to run --shutdown-mode abort",
        1.0,
    )
    _wait_ready(cluster, 2)
    base = _coordinator_url(cluster)
    # ignore_eos: each request runs its 256 tokens, so rank 1 still holds work when its SIGTERM
    # comes (the model's early stops once let every stream on rank 1 end just before it)
    migrations = counter(base, "corefleet_migrations")
    with StreamingLoad(f"{base}/v1", MODEL, clients=4, max_tokens=256, ignore_eos=True) as load:
        wait_for(lambda: _running(base).get(1, 0) > 0, 60, "requests running on rank 1")
        scaled = time.monotonic()
        cluster.kubectl("scale", f"ie/{NAME}", "--replicas=1")
        wait_for(lambda: _rank_pod(cluster, 1) is None, 30, "rank 1's pod to go")
    # Abort, not drain: rank 1 does not finish its in-flight streams itself (a drain would let
    # them run to "length" there). Each ends with finish_reason "abort", when the rank's answer
    # reaches the coordinator before its closed connection does, or else moves to rank 0 and
    # finishes there (a migration). How fast is a figure, not a test's business.
    aborted = [o for o in load.outcomes if o.finish_reason == "abort"]
    moved = counter(base, "corefleet_migrations") - migrations
    assert aborted or moved > 0, [(o.finish_reason, o.error) for o in load.outcomes]
    assert all(o.ended >= scaled for o in aborted)


def _running(base: str) -> dict[int, int]:
    return {e["rank"]: (e.get("stats") or {}).get("running", 0) for e in admin_engines(base)}


def test_delete_removes_every_process_and_namespace(cluster: LocalCluster) -> None:
    assert cluster.kubelet is not None
    pids = [w.pid for w in cluster.kubelet.workers.values() if w.pid]
    assert pids
    cluster.kubectl("delete", "ie", NAME, "--timeout=120s", timeout=150)
    wait_for(lambda: not cluster.api.objs("v1/pods", "default"), 120, "every pod to go")
    wait_for(lambda: not cluster.kubelet.namespaces(), 30, "every namespace to go")  # type: ignore[union-attr]
    for pid in pids:
        assert not pathlib.Path(f"/proc/{pid}").exists(), f"process {pid} survived"
