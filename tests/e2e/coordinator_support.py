"""The scenarios with several coordinators: the engine they run, their pods, their processes.

`apply_two_coordinators` applies the CPU example with `coordinator.replicas: 2` and one rank
(which joins both through the headless Service `<name>-coordinators`); `wait_two_coordinators`
waits until both are Ready and the rank is joined to each. `ProcessWatch` samples the kubelet's
pod workers of given pods in the background: when each was told to terminate and when its
container's process exited, with which code.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time
from typing import Any

import yaml
from cluster import REPO, LocalCluster, wait_for
from fleet_support import Sampler, admin_engines
from pod_worker import PodWorker

Pod = dict[str, Any]


def apply_two_coordinators(cluster: LocalCluster, folder: pathlib.Path) -> None:
    """`kubectl apply` the CPU example with two coordinators and one rank."""
    engine = yaml.safe_load((REPO / "examples" / "smollm2-cpu.yaml").read_text())
    engine["spec"]["dataParallelSize"] = 1  # one rank is enough, and leaves the cores to the rest
    engine["spec"]["coordinator"]["replicas"] = 2
    path = folder / "engine.yaml"
    path.write_text(yaml.safe_dump(engine))
    cluster.kubectl("apply", "-f", str(path))


def coordinator_pods(cluster: LocalCluster) -> list[Pod]:
    """The coordinator pods that are not terminating."""
    pods = json.loads(
        cluster.kubectl(
            "get", "pods", "-l", "app.kubernetes.io/component=coordinator", "-o", "json"
        )
    )["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def pod_ready(pod: Pod) -> bool:
    """The pod's Ready condition is True."""
    conditions = (pod.get("status") or {}).get("conditions") or ()
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def rank_joined(base: str) -> bool:
    """The coordinator at `base` (no /v1) lists rank 0, ready, and no other rank."""
    try:
        return [(e["rank"], e["state"]) for e in admin_engines(base)] == [(0, "ready")]
    except OSError:  # not listening (yet, or any more)
        return False


def pod_url(pod: Pod) -> str:
    """The coordinator's HTTP address at its pod (no /v1)."""
    return f"http://{pod['status']['podIP']}:8000"


def wait_two_coordinators(cluster: LocalCluster, timeout: float, not_named: set[str]) -> list[Pod]:
    """Two Ready coordinators, none of them named in `not_named`, each with the rank joined.

    Sorted by name; on a timeout the assertion carries every process's output.
    """
    try:
        pods = wait_for(
            lambda: (
                (found := coordinator_pods(cluster))
                and len(found) == 2
                and all(pod_ready(p) and p["metadata"]["name"] not in not_named for p in found)
                and found
            ),
            timeout,
            f"two Ready coordinators, none of {sorted(not_named)}",
            0.5,
        )
        for pod in pods:
            base = pod_url(pod)
            wait_for(lambda base=base: rank_joined(base), timeout, f"rank 0 in {base}")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{cluster.logs()}") from None
    return sorted(pods, key=lambda p: p["metadata"]["name"])


@dataclasses.dataclass
class Ending:
    """How a pod's container ended: when it was told to (monotonic), when it exited, its code."""

    terminating: float | None = None
    exited: float | None = None
    code: int | None = None


class ProcessWatch(Sampler):
    """Samples the pod workers of the given pods every 20 ms: `endings` by pod name."""

    def __init__(self, cluster: LocalCluster, names: list[str]) -> None:
        assert cluster.kubelet is not None
        self.workers: dict[str, PodWorker] = {}
        for name in names:
            worker = cluster.kubelet.worker("default", name)
            assert worker is not None and worker.process is not None, name
            self.workers[name] = worker
        self.endings = {name: Ending() for name in names}
        super().__init__()

    def all_exited(self) -> bool:
        """Every watched container's process has exited."""
        return all(e.code is not None for e in self.endings.values())

    def _run(self) -> None:
        while not self._stop.is_set():
            for name, worker in self.workers.items():
                ending, process = self.endings[name], worker.process
                if ending.terminating is None and worker.deleting.is_set():
                    ending.terminating = time.monotonic()
                if ending.code is None and process is not None:
                    code = process.poll()
                    if code is not None:
                        ending.exited, ending.code = time.monotonic(), code
            time.sleep(0.02)
