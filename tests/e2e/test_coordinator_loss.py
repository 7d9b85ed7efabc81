"""Two coordinators on the local cluster, and one of them killed (SIGKILL) while clients stream.
Every pod runs from the engine image (the kubelet's container mode).

The CPU example with `coordinator.replicas: 2` and one rank: the rank finds both coordinators
through the headless Service `smollm2-coordinators` and joins each. Clients stream through both
coordinators (at their pod addresses: the harness has no Service virtual IP); one coordinator's
process is killed. The survivor's clients see nothing, the dead one's streams end with an error
without waiting for it to come back, cluster DNS drops it from the API Service (Ready pods only)
but keeps it in the ranks' discovery Service, and once the kubelet has restarted it the rank
joins it again and it serves.
"""

from __future__ import annotations

import os
import pathlib
import signal
import time
from collections.abc import Iterator

import openai
import pytest
from cluster import LocalCluster, wait_for
from coordinator_support import apply_two_coordinators, pod_url, rank_joined, wait_two_coordinators
from fleet_support import Sampler, StreamingLoad
from images_support import require_images
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
    require_images()  # the pods run from them
    with LocalCluster(tmp_path / "cluster", containers=True) as local:
        yield local
        assert local.kubelet is not None
        assert not local.kubelet.errors, local.kubelet.errors


class HostsRecorder(Sampler):
    """Samples the node's Service DNS (its /etc/hosts): the addresses behind the two names."""

    def __init__(self, cluster: LocalCluster) -> None:
        assert cluster.kubelet is not None
        self.path = cluster.kubelet.node_hosts
        self.samples: list[tuple[float, set[str], set[str]]] = []  # (when, API, discovery)
        super().__init__()

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
    apply_two_coordinators(cluster, tmp_path)
    # The one rank joined both: each coordinator lists it, ready.
    victim, survivor = wait_two_coordinators(cluster, READY_TIMEOUT, not_named=set())
    doomed, kept = pod_url(victim), pod_url(survivor)
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
        wait_for(lambda: rank_joined(doomed), READY_TIMEOUT, "rank 0 back in the restarted one")
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
