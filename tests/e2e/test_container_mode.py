"""The kubelet's container mode (`LocalCluster(containers=True)`): pods from their images under
runc.

The CPU example: rank and coordinator pods run from the engine image as its user, and the chat
is answered through the coordinator's Service name; deletion leaves no container, namespace or
mount. (The whole fleet story, scale-down under load included, runs in this mode too:
test_smollm2_fleet.py, test_coordinator_loss.py, test_coordinator_rollout.py.)

And what the container mode honours of a pod spec, on pods of their own: the image's user,
runAsNonRoot, readOnlyRootFilesystem, allowPrivilegeEscalation, capabilities, an in-memory
emptyDir at /dev/shm, configMap, secret and hostPath volumes, the memory limit as a cgroup
limit, the downward API, the termination message, and SIGKILL after the grace period.
"""

from __future__ import annotations

import pathlib
import re
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from cluster import REPO, LocalCluster, wait_for
from fleet_support import admin_engines
from images_support import ENGINE_IMAGE, require_images
from netns import can_create_namespaces
from runc_runtime import RuncContainer

_why_not = can_create_namespaces()
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.skipif(_why_not is not None, reason=str(_why_not)),
]

NAME, MODEL = "smollm2", "SmolLM2-135M-Instruct"
READY_TIMEOUT = 400.0  # two ranks from the image, cold page cache, a busy 2-core machine
SERVICE = f"{NAME}-coordinator.default.svc.cluster.local"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    require_images()
    with LocalCluster(tmp_path_factory.mktemp("cluster"), containers=True) as local:
        yield local
        assert local.kubelet is not None
        assert not local.kubelet.errors, local.kubelet.errors


def _ready(cluster: LocalCluster, ranks: int) -> bool:
    lines = cluster.kubectl("get", "ie", NAME).strip().splitlines()
    row = dict(zip(lines[0].split(), lines[1].split(), strict=False))
    return row.get("RANKS") == f"{ranks}/{ranks}" and row.get("READY") == "True"


def _wait_ready(cluster: LocalCluster, ranks: int) -> None:
    try:
        wait_for(lambda: _ready(cluster, ranks), READY_TIMEOUT, f"RANKS {ranks}/{ranks}", 1.0)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{cluster.logs()}") from None


def _service_url(cluster: LocalCluster) -> str:
    """The coordinator by its Service name, resolved as a pod resolves it (cluster DNS)."""
    assert cluster.kubelet is not None
    hosts = cluster.kubelet.node_hosts.read_text().splitlines()
    addresses = [ln.split()[0] for ln in hosts if SERVICE in ln.split()[1:]]
    assert len(addresses) == 1, hosts
    return f"http://{addresses[0]}:8000"


def _uid(pid: int) -> int:
    status = pathlib.Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^Uid:\s+(\d+)", status, re.M).group(1))  # type: ignore[union-attr]


def test_example_runs_from_the_engine_image(cluster: LocalCluster) -> None:
    cluster.kubectl("apply", "-f", str(REPO / "examples" / "smollm2-cpu.yaml"))
    _wait_ready(cluster, 2)
    assert cluster.kubelet is not None
    workers = list(cluster.kubelet.workers.values())
    assert len(workers) == 3, [w.name for w in workers]  # two ranks and the coordinator
    for worker in workers:
        assert isinstance(worker.running, RuncContainer), worker.name
        assert worker.pid is not None and _uid(worker.pid) == 10001, worker.name  # USER 10001
    base = wait_for(lambda: _service_url(cluster), 60, "the coordinator's Service name")
    assert sorted(e["rank"] for e in admin_engines(base)) == [0, 1]
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24,
        temperature=0.0,
    )
    assert "Paris" in (reply.choices[0].message.content or ""), reply


PROBE = """
import os, pathlib, resource
shm = pathlib.Path('/dev/shm/probe'); shm.write_text('x')
try:
    pathlib.Path('/opt/probe').write_text('x'); root = 'writable'
except OSError as exc:
    root = exc.strerror
limit = pathlib.Path('/sys/fs/cgroup/memory/memory.limit_in_bytes').read_text().strip()
status = pathlib.Path('/proc/self/status').read_text()
caps = [ln.split()[1] for ln in status.splitlines() if ln.startswith(('CapBnd', 'NoNewPrivs'))]
mounts = [ln.split()[2] for ln in open('/proc/self/mounts') if ln.split()[1] == '/dev/shm']
print('probe', os.getuid(), root, limit, caps, mounts, os.environ['POD'], flush=True)
print('volumes', open('/etc/probe/greeting').read(), os.environ['SECRET'],
      open('/data/host.txt').read(), flush=True)
open('/dev/termination-log', 'w').write('probe done')
raise SystemExit(3)
"""


def _pod(security: dict[str, Any], host_data: pathlib.Path) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "probe", "namespace": "default"},
        "spec": {
            "restartPolicy": "Never",
            "securityContext": {"runAsNonRoot": True},
            "containers": [
                {
                    "name": "probe",
                    "image": ENGINE_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["python", "-c", PROBE],
                    "env": [
                        {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                        {
                            "name": "SECRET",
                            "valueFrom": {"secretKeyRef": {"name": "probe", "key": "token"}},
                        },
                    ],
                    "securityContext": security,
                    "resources": {"limits": {"memory": "256Mi"}},
                    "volumeMounts": [
                        {"name": "dshm", "mountPath": "/dev/shm"},
                        {"name": "config", "mountPath": "/etc/probe", "readOnly": True},
                        {"name": "data", "mountPath": "/data", "readOnly": True},
                    ],
                }
            ],
            "volumes": [
                {"name": "dshm", "emptyDir": {"medium": "Memory"}},
                {"name": "config", "configMap": {"name": "probe"}},
                {"name": "data", "hostPath": {"path": str(host_data), "type": "Directory"}},
            ],
        },
    }


def _terminated(cluster: LocalCluster) -> dict[str, Any] | None:
    pod = cluster.api.obj("v1/pods", "default", "probe") or {}
    for status in (pod.get("status") or {}).get("containerStatuses") or ():
        if "terminated" in status.get("state", {}):
            return status["state"]["terminated"]  # type: ignore[no-any-return]
    return None


def test_the_pod_spec_is_honoured(cluster: LocalCluster) -> None:
    security = {
        "readOnlyRootFilesystem": True,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
    }
    host_data = cluster.folder / "host-data"
    host_data.mkdir()
    (host_data / "host.txt").write_text("from-the-node")
    config = {"metadata": {"name": "probe"}, "data": {"greeting": "hello"}}
    cluster.api.request("POST", "/api/v1/namespaces/default/configmaps", config, expect=201)
    secret = {"metadata": {"name": "probe"}, "stringData": {"token": "s3cret"}}
    cluster.api.request("POST", "/api/v1/namespaces/default/secrets", secret, expect=201)
    pod = _pod(security, host_data)
    cluster.api.request("POST", "/api/v1/namespaces/default/pods", pod, expect=201)
    state = wait_for(lambda: _terminated(cluster), 120, "the probe pod to finish")
    assert state["exitCode"] == 3 and state["message"] == "probe done", state
    assert cluster.kubelet is not None
    line = next(ln for ln in cluster.kubelet.log("default", "probe").splitlines() if "probe " in ln)
    assert line.startswith("probe 10001 Read-only file system 268435456 "), line
    assert "['0000000000000000', '1']" in line and "['tmpfs']" in line and line.endswith(" probe")
    assert "volumes hello s3cret from-the-node" in cluster.kubelet.log("default", "probe")
    cluster.kubectl("delete", "pod", "probe", "--wait=true", timeout=60)

    as_root = _pod({"runAsUser": 0}, host_data)
    cluster.api.request("POST", "/api/v1/namespaces/default/pods", as_root, expect=201)

    def refused() -> str | None:
        pod = cluster.api.obj("v1/pods", "default", "probe") or {}
        for status in (pod.get("status") or {}).get("containerStatuses") or ():
            waiting = status.get("state", {}).get("waiting") or {}
            if waiting.get("reason") == "CreateContainerConfigError":
                return str(waiting.get("message"))
        return None

    try:
        message = wait_for(refused, 60, "runAsNonRoot to refuse root")
    except AssertionError as exc:
        pod = cluster.api.obj("v1/pods", "default", "probe") or {}
        raise AssertionError(f"{exc}: {pod.get('status')}\n{cluster.logs()}") from None
    assert "container has runAsNonRoot and image will run as root" in message, message
    cluster.kubectl("delete", "pod", "probe", "--wait=true", timeout=60)


def test_delete_removes_every_container(cluster: LocalCluster) -> None:
    assert cluster.kubelet is not None
    cluster.kubectl("delete", "ie", NAME, "--timeout=120s", timeout=150)
    wait_for(lambda: not cluster.api.objs("v1/pods", "default"), 120, "every pod to go")
    wait_for(lambda: not cluster.kubelet.namespaces(), 30, "every namespace to go")  # type: ignore[union-attr]
    wait_for(lambda: str(cluster.folder) not in pathlib.Path("/proc/self/mounts").read_text(),
             30, "every root filesystem to be unmounted")  # fmt: skip


def test_sigterm_then_sigkill_after_the_grace_period(cluster: LocalCluster) -> None:
    stubborn = "import signal, time\n" + (
        "signal.signal(signal.SIGTERM, lambda *_: print('got TERM', flush=True))\n"
        "print('up', flush=True)\n"
        "while True: time.sleep(1)\n"
    )
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "stubborn", "namespace": "default"},
        "spec": {
            "terminationGracePeriodSeconds": 3,
            "containers": [
                {"name": "main", "image": ENGINE_IMAGE, "command": ["python", "-c", stubborn]}
            ],
        },
    }
    cluster.api.request("POST", "/api/v1/namespaces/default/pods", pod, expect=201)
    assert cluster.kubelet is not None
    wait_for(lambda: "up" in cluster.kubelet.log("default", "stubborn"), 120, "the pod to start")  # type: ignore[union-attr]
    worker = cluster.kubelet.worker("default", "stubborn")
    assert worker is not None and worker.pid is not None
    pid = worker.pid
    cluster.kubectl("delete", "pod", "stubborn", "--wait=true", timeout=60)
    assert "got TERM" in cluster.kubelet.log("default", "stubborn")
    assert not pathlib.Path(f"/proc/{pid}").exists(), "the container outlived its grace period"
