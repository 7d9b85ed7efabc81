"""A mixture-of-experts InferenceEngine on the local cluster: one expert-parallel group of two
rank pods (`enableExpertParallel: true`), its loss of a rank, its drain under load, its deletion.

One cluster for the module and one engine through the steps, in order (each starts from where
the previous one left the group): the tiny random Qwen3-MoE of `tests.fixtures_moe` reaches the
ranks and the coordinator through a hostPath volume; the ranks meet at rank 0's stable name
(`moe-engine-0.moe-engine:29550`, the headless Service's pod DNS) and split the experts.

1. The group serves, through the coordinator, the same greedy text as one in-process engine
   holding every expert (DP=1).
2. SIGKILL of rank 1's process while two long streams run: the whole group restarts
   (`Ready=False/ExpertParallelGroupRestarting`), comes back, and both streams complete with
   the text one engine gives (the coordinator migrated them), then new requests succeed.
3. A rollout (a new `maxNumSeqs`, which the operator applies to every rank at once) under load:
   SIGTERM reaches both ranks together, they drain and exit 0, no request fails (a 503 with
   Retry-After while no rank serves is retried, as the OpenAI client does), and the new group
   serves. Deleting the engine then drains it again (exit 0) and leaves nothing behind.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import pathlib
import re
import signal
import threading
import time
from collections.abc import Collection, Iterator
from typing import Any

import openai
import pytest
import yaml
from cluster import LocalCluster, wait_for
from coordinator_support import ProcessWatch
from fleet_support import StatusRecorder, admin_engines, counter
from netns import can_create_namespaces

from tests.fixtures_moe import write_tiny_moe

_why_not = can_create_namespaces()
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.skipif(_why_not is not None, reason=str(_why_not)),
]

NAME, MODEL = "moe", "tiny-moe"
RANKS = (0, 1)
READY_TIMEOUT = 240.0  # a group of two ranks (re)forming and loading on a busy 2-core machine
PROMPTS = ["Hello world", "The quick brown fox"]
LONG = 160  # tokens of a stream that must outlive a group restart (the model knows 256 positions)
MAX_NUM_SEQS = 8  # per rank; with the model's 256 positions it sizes the CPU KV cache (small)


@dataclasses.dataclass(frozen=True)
class Moe:
    """The tiny model's folder on the node, and one in-process engine's greedy texts of
    PROMPTS (`LONG` tokens, ignore_eos): what every rank layout must give."""

    folder: pathlib.Path
    expected: list[str]


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Moe:
    folder = write_tiny_moe(tmp_path_factory.mktemp("moe") / "qwen3-moe")
    from corefleet.engine import LLM, SamplingParams

    # One engine in this process, DP=1, every expert on it (no group), as the ranks' dtype.
    llm = LLM(
        str(folder), multiprocess=False, dtype="float32", kv_cache_memory=8 << 20, block_size=8
    )
    params = SamplingParams(max_tokens=LONG, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    llm.shutdown()
    return Moe(folder, [o.outputs[0].text for o in outputs])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("cluster")) as local:
        yield local
        assert local.kubelet is not None
        assert not local.kubelet.errors, local.kubelet.errors


def _engine_manifest(folder: pathlib.Path, max_num_seqs: int) -> dict[str, Any]:
    """The group: two ranks of the tiny MoE, one CPU each, the model on a hostPath volume
    mounted at its own path (the node has no /models to mount over)."""
    return {
        "apiVersion": "corefleet.dev/v1alpha1",
        "kind": "InferenceEngine",
        "metadata": {"name": NAME},
        "spec": {
            "image": "ghcr.io/corefleet/corefleet:0.1.0",
            "model": {
                "path": str(folder),
                "mountPath": str(folder),
                "volume": {"hostPath": {"path": str(folder), "type": "Directory"}},
                "servedModelName": MODEL,
                "dtype": "float32",
            },
            "dataParallelSize": len(RANKS),
            "enableExpertParallel": True,
            "resources": {"requests": {"cpu": "1", "memory": "1Gi"}},
            "engine": {"maxNumSeqs": max_num_seqs, "blockSize": 8},
            "shutdown": {"mode": "Drain", "drainTimeoutSeconds": 30},
            "coordinator": {"replicas": 1, "resources": {"requests": {"cpu": "250m"}}},
        },
    }


def _ready_row(cluster: LocalCluster) -> bool:
    lines = cluster.kubectl("get", "ie", NAME).strip().splitlines()
    row = dict(zip(lines[0].split(), lines[1].split(), strict=False))
    return row.get("RANKS") == f"{len(RANKS)}/{len(RANKS)}" and row.get("READY") == "True"


def _group_ready(base: str, old_pids: Collection[int]) -> bool:
    """The coordinator lists both ranks ready in a group of 2, in processes not in old_pids."""
    try:
        engines = admin_engines(base)
    except OSError:
        return False
    ready = [
        e
        for e in engines
        if e["state"] == "ready" and e.get("dp_size") == len(RANKS) and e["pid"] not in old_pids
    ]
    return sorted(e["rank"] for e in ready) == list(RANKS)


def _wait_group(cluster: LocalCluster, old_pids: Collection[int] = ()) -> str:
    """Wait for the engine Ready (kubectl's columns) and its group joined to the coordinator
    (new processes only); the coordinator's base URL. On a timeout: every process's output."""
    try:
        wait_for(lambda: _ready_row(cluster), READY_TIMEOUT, "RANKS 2/2 and READY True", 0.5)
        base = _coordinator_url(cluster)
        wait_for(
            lambda: _group_ready(base, old_pids), READY_TIMEOUT, "the group in the coordinator"
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{cluster.logs()}") from None
    return base


def _coordinator_url(cluster: LocalCluster) -> str:
    """The one Ready coordinator's address (the harness has no Service virtual IP)."""

    def the_one() -> dict[str, Any] | None:
        pods = json.loads(
            cluster.kubectl(
                "get", "pods", "-l", "app.kubernetes.io/component=coordinator", "-o", "json"
            )
        )["items"]
        ready = [
            p
            for p in pods
            if not p["metadata"].get("deletionTimestamp")
            and any(
                c.get("type") == "Ready" and c.get("status") == "True"
                for c in (p.get("status") or {}).get("conditions") or ()
            )
        ]
        return ready[0] if len(pods) == 1 and ready else None

    pod = wait_for(the_one, READY_TIMEOUT, "one Ready coordinator pod", 0.5)
    return f"http://{pod['status']['podIP']}:8000"


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=180)


def _stream(base: str, prompt: str, started: threading.Event) -> tuple[str, str | None]:
    """A streamed greedy completion of LONG tokens; `started` is set after a few chunks.
    Its text and finish reason."""
    stream = _client(base).completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=LONG,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    text, finish = "", None
    for n, chunk in enumerate(stream, 1):
        for choice in chunk.choices:
            text += choice.text
            finish = choice.finish_reason or finish
        if n >= 5:
            started.set()
    return text, finish


def _rank_pids(cluster: LocalCluster) -> dict[int, int]:
    """Each rank pod's container process (the kubelet's), by rank."""
    assert cluster.kubelet is not None
    pids = {}
    for rank in RANKS:
        worker = cluster.kubelet.worker("default", f"{NAME}-engine-{rank}")
        assert worker is not None and worker.pid is not None, rank
        pids[rank] = worker.pid
    return pids


def test_the_group_serves_what_one_engine_gives(cluster: LocalCluster, moe: Moe) -> None:
    manifest = cluster.folder / "engine.yaml"
    manifest.write_text(yaml.safe_dump(_engine_manifest(moe.folder, MAX_NUM_SEQS)))
    cluster.kubectl("apply", "-f", str(manifest))
    base = _wait_group(cluster)
    rank0 = cluster.api.obj("v1/pods", "default", f"{NAME}-engine-0") or {}
    args = " ".join(rank0["spec"]["containers"][0]["args"])
    assert f"--data-parallel-address {NAME}-engine-0.{NAME}-engine:29550" in args, args
    assert "--enable-expert-parallel" in args and "--data-parallel-size 2" in args, args
    # Two at once: least-loaded routing gives one to each rank (while the other rank steps
    # dummy batches into every MoE layer's exchange); each equals one engine alone.
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(lambda prompt: _complete(base, prompt), PROMPTS))
    assert results == [(text, "length") for text in moe.expected]


def _complete(base: str, prompt: str) -> tuple[str, str | None]:
    """A greedy completion of LONG tokens (not streamed): its text and finish reason."""
    reply = _client(base).completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=LONG,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    return reply.choices[0].text, reply.choices[0].finish_reason


def test_sigkill_of_one_rank_restarts_the_group_and_streams_continue(
    cluster: LocalCluster, moe: Moe
) -> None:
    base = _coordinator_url(cluster)
    old = _rank_pids(cluster)
    results: dict[int, tuple[str, str | None] | BaseException] = {}
    events = [threading.Event() for _ in PROMPTS]

    def run(i: int) -> None:
        try:
            results[i] = _stream(base, PROMPTS[i], events[i])
        except BaseException as exc:  # reported by the assertion below
            results[i] = exc
            events[i].set()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(PROMPTS))]
    migrations = counter(base, "corefleet_migrations")
    with StatusRecorder(cluster, NAME) as status:
        for thread in threads:
            thread.start()
        assert all(e.wait(READY_TIMEOUT) for e in events), "the streams did not start"
        os.kill(old[1], signal.SIGKILL)
        # The group is back: new processes for both ranks, joined to the coordinator.
        _wait_group(cluster, set(old.values()))
        for thread in threads:
            thread.join(READY_TIMEOUT)
        wait_for(
            lambda: ("True", "AllRanksReady") in list(status.conditions("Ready"))[-1:],
            30,
            "Ready=True/AllRanksReady recorded",
        )
    ready = list(status.conditions("Ready"))
    assert ("False", "ExpertParallelGroupRestarting") in ready, ready
    # Both streams went on, the killed rank's and its peer's (which the group took down), and
    # the migrated greedy continuations are exactly one engine's text.
    assert results == {i: (text, "length") for i, text in enumerate(moe.expected)}, results
    # Both ranks died, so both streams, wherever they ran, moved to the group formed again.
    assert counter(base, "corefleet_migrations") - migrations >= len(PROMPTS)
    # Both restarted in place by the kubelet: rank 1 killed, rank 0 out by its own exit 1 (its
    # collective with rank 1 failed), not by a kill.
    last = {}
    for rank in RANKS:
        pod = cluster.api.obj("v1/pods", "default", f"{NAME}-engine-{rank}") or {}
        container = pod["status"]["containerStatuses"][0]
        assert container["restartCount"] >= 1, (rank, container)
        last[rank] = container["lastState"]["terminated"]
    assert last[1].get("signal") == signal.SIGKILL, last
    assert last[0]["exitCode"] == 1 and "signal" not in last[0], last
    assert _complete(base, PROMPTS[0]) == (moe.expected[0], "length")  # the new group serves


@dataclasses.dataclass
class Outcome:
    """One request of `RetryingLoad`: its finish reason and text, or its error."""

    finish_reason: str | None
    text: str
    error: str | None
    retries: int  # 503s with Retry-After before it was admitted


class RetryingLoad:
    """`clients` threads streaming LONG-token completions back to back until stopped.

    A 503 with Retry-After (no rank serves for now: the group is draining or loading) is retried
    after a pause, as the OpenAI client would; anything else that is not a completed stream is
    a failure. Retrying here, not in the client (max_retries=0), keeps every other error seen.
    """

    def __init__(self, base: str, clients: int) -> None:
        self.base = base
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)
        ]

    def __enter__(self) -> RetryingLoad:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(READY_TIMEOUT)

    def _client(self, index: int) -> None:
        client, n = _client(self.base), index
        while not self._stop.is_set():
            self.outcomes.append(self._one(client, PROMPTS[n % len(PROMPTS)]))
            n += 1

    def _one(self, client: openai.OpenAI, prompt: str) -> Outcome:
        retries = 0
        while True:
            text, finish = "", None
            try:
                stream = client.completions.create(
                    model=MODEL,
                    prompt=prompt,
                    max_tokens=LONG,
                    temperature=0.0,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                for chunk in stream:
                    for choice in chunk.choices:
                        text += choice.text
                        finish = choice.finish_reason or finish
            except openai.APIStatusError as exc:
                if exc.status_code == 503 and "retry-after" in exc.response.headers:
                    retries += 1
                    time.sleep(0.2)
                    continue
                return Outcome(finish, text, f"{type(exc).__name__}: {exc}", retries)
            except Exception as exc:  # a broken stream or connection: a failure, kept as such
                return Outcome(finish, text, f"{type(exc).__name__}: {exc}", retries)
            return Outcome(finish, text, None, retries)

    def completed(self) -> int:
        return len(self.outcomes)

    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.error or o.finish_reason != "length" or not o.text]


def _running(base: str) -> dict[int, int]:
    try:
        return {e["rank"]: (e.get("stats") or {}).get("running", 0) for e in admin_engines(base)}
    except OSError:
        return {}


def test_a_rollout_drains_the_group_under_load_with_no_failed_request(
    cluster: LocalCluster,
) -> None:
    base = _coordinator_url(cluster)
    old = _rank_pids(cluster)
    names = [f"{NAME}-engine-{r}" for r in RANKS]
    patch = json.dumps({"spec": {"engine": {"maxNumSeqs": MAX_NUM_SEQS - 2}}})
    migrations = counter(base, "corefleet_migrations")
    with RetryingLoad(base, clients=4) as load, ProcessWatch(cluster, names) as watch:
        wait_for(lambda: load.completed() >= 2, READY_TIMEOUT, "requests served before the roll")
        wait_for(
            lambda: all(_running(base).get(r, 0) > 0 for r in RANKS),
            60,
            "requests running on both ranks",
            0.05,
        )
        cluster.kubectl("patch", "ie", NAME, "--type", "merge", "-p", patch)
        wait_for(watch.all_exited, READY_TIMEOUT, "both old ranks to exit")
        base_after = _wait_group(cluster, set(old.values()))
        assert base_after == base  # the coordinator's command has no maxNumSeqs: it stayed
        served = load.completed()
        wait_for(lambda: load.completed() >= served + 4, READY_TIMEOUT, "the new group serving")
    assert load.failures() == [], load.failures()
    # SIGTERM reached both ranks before either exited (one reconcile deleted both pods), and
    # the group drained as one: each rank finished its own streams (none moved) and exited 0.
    endings = [watch.endings[n] for n in names]
    assert all(e.terminating is not None and e.exited is not None for e in endings), endings
    assert max(e.terminating or 0.0 for e in endings) <= min(e.exited or 0.0 for e in endings)
    assert [e.code for e in endings] == [0] * len(names), endings
    assert counter(base, "corefleet_migrations") == migrations
    assert cluster.kubelet is not None
    logs = "".join(cluster.kubelet.log("default", n) for n in names)
    drained = [int(n) for n in re.findall(r"rank \d: draining (\d+) request", logs)]
    assert drained and max(drained) >= 1, logs[-3000:]  # work was in flight at the SIGTERM
    for name in names:
        pod = cluster.api.obj("v1/pods", "default", name) or {}
        assert "--max-num-seqs 6" in " ".join(pod["spec"]["containers"][0]["args"]), name


def test_delete_drains_the_group_and_leaves_nothing_behind(cluster: LocalCluster) -> None:
    assert cluster.kubelet is not None
    names = [f"{NAME}-engine-{r}" for r in RANKS]
    pids = [w.pid for w in cluster.kubelet.workers.values() if w.pid]
    with ProcessWatch(cluster, names) as watch:
        cluster.kubectl("delete", "ie", NAME, "--timeout=120s", timeout=150)
        wait_for(lambda: not cluster.api.objs("v1/pods", "default"), 120, "every pod to go")
        wait_for(watch.all_exited, 30, "both ranks to exit")
    wait_for(lambda: not cluster.kubelet.namespaces(), 30, "every namespace to go")  # type: ignore[union-attr]
    for pid in pids:
        assert not pathlib.Path(f"/proc/{pid}").exists(), f"process {pid} survived"
    codes = {n: watch.endings[n].code for n in names}
    assert codes == dict.fromkeys(names, 0), watch.endings
