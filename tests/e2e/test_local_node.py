"""The local node on its own (no operator, no model) in a real control plane: pods as processes
in their own network namespaces, Service DNS, probes, restarts, graceful termination, the real
scheduler's and controller manager's work on them (placement, Deployments, rolling updates),
and nothing left behind. Small shell containers.
"""

from __future__ import annotations

import json
import logging
import pathlib
import shlex
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from cluster import LocalCluster, wait_for
from netns import can_create_namespaces
from node_object import this_machine

_why_not = can_create_namespaces()
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(_why_not is not None, reason=str(_why_not))]

PODS = "/api/v1/namespaces/default/pods"


@pytest.fixture
def node(tmp_path: pathlib.Path) -> Iterator[LocalCluster]:
    """The node with a 1 s restart back-off and this machine's own size, on a real control plane
    without the operator; checks that it leaves no namespace behind."""
    with LocalCluster(tmp_path, backoff_base=1.0, operator=False, node=this_machine()) as cluster:
        assert cluster.kubelet is not None and cluster.kubelet.network is not None
        prefix = cluster.kubelet.network.prefix
        yield cluster
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert prefix not in left, left
    assert not cluster.kubelet.errors, cluster.kubelet.errors


def _pod(name: str, script: str, **spec: Any) -> dict[str, Any]:
    labels = spec.pop("labels", {})
    container = {"name": "main", "image": "corefleet:dev", "command": ["sh", "-c", script]}
    container.update(spec.pop("container", {}))
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {"containers": [container], **spec},
    }


def _status(node: LocalCluster, name: str) -> dict[str, Any]:
    obj = node.api.obj("v1/pods", "default", name)
    return (obj or {}).get("status") or {}


def _container(node: LocalCluster, name: str) -> dict[str, Any]:
    return (_status(node, name).get("containerStatuses") or [{}])[0]  # type: ignore[no-any-return]


def test_pods_get_own_addresses_and_find_services_by_name(node: LocalCluster) -> None:
    server = _pod(
        "web",
        "exec python3 -m http.server 8080",
        labels={"app": "web"},
        container={
            "ports": [{"name": "http", "containerPort": 8080}],
            "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 5},
            "env": [{"name": "MY_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        },
    )
    client = _pod(
        "client",
        'echo ip=$MY_IP; python3 -c "import urllib.request as u; '
        "print('status', u.urlopen('http://web:8080/', timeout=5).status)\"; "
        'python3 -c "import urllib.request as u; '
        "print('fqdn', u.urlopen('http://web.default.svc.cluster.local:8080/').status)\"; "
        # its own name, as a pod's: it resolves to its address (gloo binds that way)
        "python3 -c \"import socket as s; print('self', s.gethostbyname(s.gethostname()))\"; "
        "sleep 600",
        container={
            "env": [{"name": "MY_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
        },
    )
    node.api.request("POST", PODS, server, expect=201)
    service = {
        "metadata": {"name": "web"},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 8080}]},
    }
    node.api.request("POST", "/api/v1/namespaces/default/services", service, expect=201)
    wait_for(lambda: _container(node, "web").get("ready"), 30, "web to be Ready")
    node.api.request("POST", PODS, client, expect=201)
    assert node.kubelet is not None
    wait_for(lambda: "self " in node.kubelet.log("default", "client"), 30, "client output")  # type: ignore[union-attr]
    log = node.kubelet.log("default", "client")
    ips = {_status(node, "web")["podIP"], _status(node, "client")["podIP"]}
    assert len(ips) == 2
    assert f"ip={_status(node, 'client')['podIP']}" in log and "status 200" in log
    assert "fqdn 200" in log and f"self {_status(node, 'client')['podIP']}" in log
    namespaces = node.kubelet.namespaces()
    assert len(namespaces) == 2 and all(
        n.startswith(node.kubelet.network.prefix) for n in namespaces
    )  # type: ignore[union-attr]


def test_a_headless_service_name_resolves_to_every_pod_it_publishes(node: LocalCluster) -> None:
    # As cluster DNS does: a headless Service's name answers with every Ready pod's address, or
    # with every pod's under publishNotReadyAddresses (the operator's NAME-coordinators).
    # Nothing listens on port 9: the probe never passes. "loading" has a hostname under the
    # headless Service all-peers, as a rank pod under NAME-engine: `loading.all-peers` resolves
    # to it while it is not Ready (an expert-parallel group's rendezvous is rank 0's name).
    never_ready = {"readinessProbe": {"httpGet": {"path": "/", "port": 9}, "periodSeconds": 1}}
    named = {"hostname": "loading", "subdomain": "all-peers"}
    for name, extra, host in (("ready", {}, {}), ("loading", never_ready, named)):
        pod = _pod(name, "exec sleep 600", labels={"app": "peer"}, container=extra, **host)
        node.api.request("POST", PODS, pod, expect=201)
    for name, all_pods in (("all-peers", True), ("ready-peers", False)):
        spec = {"clusterIP": "None", "selector": {"app": "peer"}, "ports": [{"port": 5570}]}
        service = {
            "metadata": {"name": name},
            "spec": {**spec, "publishNotReadyAddresses": all_pods},
        }
        node.api.request("POST", "/api/v1/namespaces/default/services", service, expect=201)
    # getaddrinfo, as a rank resolves --coordinator; printed until the test has what it needs.
    resolve = (
        "import socket, time\n"
        "def ips(n):\n"
        "    try: return sorted({a[4][0] for a in socket.getaddrinfo(n, 5570)})\n"
        "    except OSError: return []\n"
        "while True:\n"
        "    print('all', ips('all-peers'), 'ready', ips('ready-peers'),\n"
        "          'host', ips('loading.all-peers'), flush=True)\n"
        "    time.sleep(0.2)\n"
    )
    node.api.request(
        "POST", PODS, _pod("client", f"exec python3 -c {shlex.quote(resolve)}"), expect=201
    )
    wait_for(
        lambda: _status(node, "ready").get("podIP") and _status(node, "loading").get("podIP"),
        30,
        "IPs",
    )
    both = sorted([_status(node, "ready")["podIP"], _status(node, "loading")["podIP"]])
    loading = [_status(node, "loading")["podIP"]]
    want = f"all {both} ready {[_status(node, 'ready')['podIP']]} host {loading}"
    assert node.kubelet is not None
    wait_for(lambda: want in node.kubelet.log("default", "client"), 30, want)  # type: ignore[union-attr]


def test_a_crashing_container_restarts_then_backs_off(node: LocalCluster) -> None:
    node.api.request("POST", PODS, _pod("crash", "echo started; exit 3"), expect=201)
    wait_for(lambda: _container(node, "crash").get("restartCount", 0) >= 2, 30, "two restarts")
    wait_for(
        lambda: (
            _container(node, "crash").get("state", {}).get("waiting", {}).get("reason")
            == "CrashLoopBackOff"
        ),
        30,
        "CrashLoopBackOff",
        0.05,
    )
    last = _container(node, "crash")["lastState"]["terminated"]
    assert (last["exitCode"], last["reason"]) == (3, "Error")
    printed = node.kubectl("get", "pods", "crash")
    assert "CrashLoopBackOff" in printed, printed
    runs = _container(node, "crash")["restartCount"] + 1
    assert node.kubectl("logs", "crash").count("started") >= runs  # every run's output


def test_deletion_sends_sigterm_then_sigkill_after_the_grace_period(
    node: LocalCluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kubelet")
    polite = _pod("polite", "trap 'echo got TERM; exit 0' TERM; while true; do sleep 0.1; done")
    stubborn = _pod(
        "stubborn",
        "trap 'echo ignoring TERM' TERM; while true; do sleep 0.1; done",
        terminationGracePeriodSeconds=2,
    )
    for pod in (polite, stubborn):
        node.api.request("POST", PODS, pod, expect=201)
    assert node.kubelet is not None
    wait_for(
        lambda: all(
            node.kubelet.worker("default", n) and node.kubelet.worker("default", n).pid
            for n in ("polite", "stubborn")
        ),
        30,
        "both running",
    )  # type: ignore[union-attr]
    pids = {n: node.kubelet.worker("default", n).pid for n in ("polite", "stubborn")}  # type: ignore[union-attr]
    started = time.monotonic()
    node.kubectl("delete", "pod", "polite", "stubborn", "--wait=true", "--timeout=30s", timeout=40)
    took = time.monotonic() - started
    assert "got TERM" in node.kubelet.log("default", "polite")
    assert "ignoring TERM" in node.kubelet.log("default", "stubborn")
    # The stubborn one is killed when its own 2 s are over (kubectl's 30 s timeout is the
    # default grace period: waiting that long would have failed the delete).
    assert took >= 2.0, took
    killed = [r.getMessage() for r in caplog.records if "grace period over" in r.getMessage()]
    assert killed == ["default/stubborn: grace period over; SIGKILL"], killed
    for pid in pids.values():
        assert not pathlib.Path(f"/proc/{pid}").exists()
    assert node.kubelet.namespaces() == []


def test_gpu_pods_stay_pending_with_the_schedulers_message(node: LocalCluster) -> None:
    gpu = _pod("gpu", "true", container={"resources": {"limits": {"nvidia.com/gpu": 1}}})
    elsewhere = _pod("arm", "true", nodeSelector={"kubernetes.io/arch": "s390x"})
    for pod in (gpu, elsewhere):
        node.api.request("POST", PODS, pod, expect=201)
    wait_for(
        lambda: _status(node, "gpu").get("conditions") and _status(node, "arm").get("conditions"),
        60,
        "scheduling",
    )
    gpu_cond = _status(node, "gpu")["conditions"][0]
    assert (gpu_cond["status"], gpu_cond["reason"]) == ("False", "Unschedulable")
    assert "Insufficient nvidia.com/gpu" in gpu_cond["message"]
    assert "node affinity/selector" in _status(node, "arm")["conditions"][0]["message"]
    assert _status(node, "gpu")["phase"] == "Pending"


def test_a_deployment_keeps_its_pods_and_recreates_them_on_a_new_template(
    node: LocalCluster,
) -> None:
    body = {
        "metadata": {"name": "app"},
        "spec": {
            "replicas": 2,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": {"app": "x"}},
            "template": {
                "metadata": {"labels": {"app": "x"}},
                "spec": {
                    "containers": [
                        {"name": "c", "image": "corefleet:dev", "command": ["sleep", "600"]}
                    ]
                },
            },
        },
    }
    node.api.request("POST", "/apis/apps/v1/namespaces/default/deployments", body, expect=201)

    def running() -> list[str]:
        return sorted(
            p["metadata"]["name"]
            for p in node.api.objs("v1/pods", "default")
            if (p.get("status") or {}).get("phase") == "Running"
            and not p["metadata"].get("deletionTimestamp")
        )

    first = wait_for(lambda: len(running()) == 2 and running(), 30, "two pods")
    node.kubectl("delete", "pod", first[0], "--wait=false")
    wait_for(lambda: len(running()) == 2 and first[0] not in running(), 30, "a replacement")
    patch = {
        "spec": {
            "template": {
                "spec": {
                    "containers": [
                        {"name": "c", "image": "corefleet:dev", "command": ["sleep", "601"]}
                    ]
                }
            }
        }
    }
    node.kubectl("patch", "deployment", "app", "--type", "merge", "-p", json.dumps(patch))
    wait_for(lambda: len(running()) == 2 and not set(running()) & set(first), 30, "new pods")
    dep = node.api.obj("apps/v1/deployments", "default", "app") or {}
    wait_for(
        lambda: (
            (node.api.obj("apps/v1/deployments", "default", "app") or {})
            .get("status", {})
            .get("availableReplicas")
            == 2
        ),
        60,
        "status",
    )
    assert dep
    node.kubectl("delete", "deployment", "app", "--wait=false")
    wait_for(lambda: not node.api.objs("v1/pods", "default"), 30, "the pods to go with it")


def test_a_rolling_update_keeps_within_max_surge_and_max_unavailable(node: LocalCluster) -> None:
    # The coordinators' strategy: one new pod at a time, an old one goes only once a new one
    # is Ready, so there are never fewer Ready pods than replicas, nor more than one extra.
    def body(version: str) -> dict[str, Any]:
        script = f"sleep 0.5; exec python3 -m http.server 8080  # {version}"
        container = {
            "name": "c",
            "image": "corefleet:dev",
            "command": ["sh", "-c", script],
            "ports": [{"name": "http", "containerPort": 8080}],
            "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1},
        }
        return {
            "metadata": {"name": "roll"},
            "spec": {
                "replicas": 2,
                "strategy": {
                    "type": "RollingUpdate",
                    "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
                },
                "selector": {"matchLabels": {"app": "roll"}},
                "template": {
                    "metadata": {"labels": {"app": "roll"}},
                    "spec": {"containers": [container]},
                },
            },
        }

    def pods() -> list[dict[str, Any]]:
        return [
            p
            for p in node.api.objs("v1/pods", "default")
            if not p["metadata"].get("deletionTimestamp")
        ]

    def ready() -> list[str]:
        return [p["metadata"]["name"] for p in pods() if _container_ready(p)]

    deployments = "/apis/apps/v1/namespaces/default/deployments"
    node.api.request("POST", deployments, body("v1"), expect=201)
    first = set(wait_for(lambda: len(ready()) == 2 and ready(), 60, "two Ready pods"))
    seen: list[tuple[int, int]] = []  # (live pods, Ready pods)
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            live = pods()
            seen.append((len(live), sum(_container_ready(p) for p in live)))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    new_template = {"spec": {"template": body("v2")["spec"]["template"]}}
    node.kubectl("patch", "deployment", "roll", "--type", "merge", "-p", json.dumps(new_template))
    try:
        wait_for(lambda: len(ready()) == 2 and not set(ready()) & first, 60, "two new Ready pods")
    finally:
        stop.set()
        sampler.join(10)
    assert max(live for live, _ in seen) == 3, seen  # one surge pod, never two
    assert min(r for _, r in seen) >= 2, seen  # never fewer Ready than replicas


def _container_ready(pod: dict[str, Any]) -> bool:
    statuses = (pod.get("status") or {}).get("containerStatuses") or [{}]
    return bool(statuses[0].get("ready"))


def test_an_unknown_image_fails_like_a_pull(node: LocalCluster) -> None:
    pod = _pod("nope", "true", container={"image": "example.com/nothing:1"})
    node.api.request("POST", PODS, pod, expect=201)
    wait_for(
        lambda: (
            _container(node, "nope").get("state", {}).get("waiting", {}).get("reason")
            in ("ErrImagePull", "ImagePullBackOff")
        ),
        60,
        "a pull error",
    )
    assert "example.com/nothing:1" in _container(node, "nope")["state"]["waiting"]["message"]
