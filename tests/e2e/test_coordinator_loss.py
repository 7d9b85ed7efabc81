"""Two coordinators on the local cluster, and one of them killed (SIGKILL) while clients stream.

The CPU example with `coordinator.replicas: 2` and one rank: the rank finds both coordinators
through the headless Service `smollm2-coordinators` and joins each. Clients stream through both
coordinators (at their pod addresses: the harness has no Service virtual IP); one coordinator's
process is killed. The survivor's clients see nothing, the dead one's streams end with an error
without waiting for it to come back, cluster DNS drops it from the API Service (Ready pods only)
but keeps it in the ranks' discovery Service, and once the kubelet has restarted it the rank
joins it again and it serves.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import yaml
from cluster import REPO, LocalCluster, wait_for
from fleet_support import StreamingLoad, admin_engines
from netns import can_create_namespaces

_why_not = can_create_namespaces()
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.skipif(_why_not is not None, reason=str(_why_not)),
]

NAME, MODEL = "smollm2", "SmolLM2-135M-Instruct"
READY_TIMEOUT = 240.0  # a rank loading SmolLM2 and two coordinators on a busy 2-core machine
API = f"{NAME}-coordinator.default.svc.cluster.local"
DISCOVERY = f"{NAME}-coordinators.default.svc.cluster.local"


@pytest.fixture
def cluster(tmp_path: pathlib.Path) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path / "cluster") as local:
        yield local
        assert local.kubelet is not None
        assert not local.kubelet.errors, local.kubelet.errors


def _apply_two_coordinators(cluster: LocalCluster, folder: pathlib.Path) -> None:
    engine = yaml.safe_load((REPO / "examples" / "smollm2-cpu.yaml").read_text())
    engine["spec"]["dataParallelSize"] = 1  # one rank is enough, and leaves the cores to the rest
    engine["spec"]["coordinator"]["replicas"] = 2
    path = folder / "engine.yaml"
    path.write_text(yaml.safe_dump(engine))
    cluster.kubectl("apply", "-f", str(path))


def _coordinators(cluster: LocalCluster) -> list[dict[str, Any]]:
    pods = json.loads(
        cluster.kubectl(
            "get", "pods", "-l", "app.kubernetes.io/component=coordinator", "-o", "json"
        )
    )["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def _ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or ()
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _rank_joined(base: str) -> bool:
    try:
        return [(e["rank"], e["state"]) for e in admin_engines(base)] == [(0, "ready")]
    except OSError:  # not listening (yet, or any more)
        return False


class HostsRecorder:
    """Samples the node's Service DNS (its /etc/hosts): the addresses behind the two names."""

    def __init__(self, cluster: LocalCluster) -> None:
        assert cluster.kubelet is not None
        self.path = cluster.kubelet.node_hosts
        self.samples: list[tuple[float, set[str], set[str]]] = []  # (when, API, discovery)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> HostsRecorder:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        last = None
        while not self._stop.is_set():
            # The kubelet rewrites the file in place (truncate, write): a read may catch it
            # half written, so a content counts once two reads in a row agree.
            text = self.path.read_text()
            if text == last:
                api: set[str] = set()
                discovery: set[str] = set()
                for line in text.splitlines():
                    ip, _, name = line.partition(" ")
                    if name == API:
                        api.add(ip)
                    elif name == DISCOVERY:
                        discovery.add(ip)
                self.samples.append((time.monotonic(), api, discovery))
            last = text
            time.sleep(0.05)


def test_killing_one_coordinator_leaves_the_other_serving(
    cluster: LocalCluster, tmp_path: pathlib.Path
) -> None:
    assert cluster.kubelet is not None
    _apply_two_coordinators(cluster, tmp_path)
    try:
        pods = wait_for(
            lambda: (
                (found := _coordinators(cluster))
                and len(found) == 2
                and all(_ready(p) for p in found)
                and found
            ),
            READY_TIMEOUT,
            "two Ready coordinators",
            0.5,
        )
        victim, survivor = sorted(pods, key=lambda p: p["metadata"]["name"])
        urls = {p["metadata"]["name"]: f"http://{p['status']['podIP']}:8000" for p in pods}
        doomed, kept = urls[victim["metadata"]["name"]], urls[survivor["metadata"]["name"]]
        # The one rank joined both: each coordinator lists it, ready.
        for base in (doomed, kept):
            wait_for(lambda base=base: _rank_joined(base), READY_TIMEOUT, f"rank 0 in {base}")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{cluster.logs()}") from None
    worker = cluster.kubelet.worker("default", victim["metadata"]["name"])
    assert worker is not None and worker.pid is not None
    victim_ip = victim["status"]["podIP"]

    # ignore_eos: every stream runs its 256 tokens, so the doomed coordinator holds open
    # streams at any moment of the load.
    on_doomed = StreamingLoad(f"{doomed}/v1", MODEL, clients=2, max_tokens=256, ignore_eos=True)
    on_kept = StreamingLoad(f"{kept}/v1", MODEL, clients=2, max_tokens=64, ignore_eos=True)
    with HostsRecorder(cluster) as hosts, on_kept:
        with on_doomed:
            on_doomed.wait_completed(1, 180)
            on_kept.wait_completed(2, 180)
            os.kill(worker.pid, signal.SIGKILL)
            killed = time.monotonic()
            after_kill = len(on_kept.outcomes)
        # Leaving the block stops the doomed clients once their requests end: they ended.
        assert on_doomed.clients_running() == 0
        on_kept.wait_completed(after_kill + 3, 180)  # new requests on the survivor succeed
        # The kubelet restarts the coordinator; the rank joins it again and it serves.
        wait_for(lambda: _rank_joined(doomed), READY_TIMEOUT, "rank 0 back in the restarted one")
        back = time.monotonic()
        wait_for(lambda: any(t > back and victim_ip in a for t, a, _ in hosts.samples), 60, "DNS")

    assert not on_kept.failures(), on_kept.failures()
    assert any(o.started > killed for o in on_kept.outcomes if not o.error)
    # The streams open on the killed coordinator ended with an error (one whose last chunk
    # was already on its way may have finished), none silently cut short, and none of them
    # waited for its restart.
    cut = [o for o in on_doomed.outcomes if o.started < killed <= o.ended]
    summary = [(o.finish_reason, o.error) for o in cut]
    assert any(o.error for o in cut), summary
    assert all(o.error or o.finish_reason == "length" for o in cut), summary
    assert all(o.ended < back for o in cut)
    # Cluster DNS: between the kill and the restart, the API Service named only the survivor,
    # while the ranks' discovery Service still named both.
    both = {victim_ip, survivor["status"]["podIP"]}
    gap = [(a, d) for t, a, d in hosts.samples if killed < t < back and victim_ip not in a]
    assert gap, "the killed coordinator never left the API Service"
    assert all(a == {survivor["status"]["podIP"]} and d == both for a, d in gap), gap[:3]
    client = openai.OpenAI(base_url=f"{doomed}/v1", api_key="unused", max_retries=0)
    reply = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=4)
    assert reply.choices[0].text
