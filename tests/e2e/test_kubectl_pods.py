"""Pods and Deployments through the real kubectl on a real kube-apiserver: the tables the server
prints, graceful deletion, garbage collection, binding.

No kubelet runs: the test plays it by PATCHing `pods/<name>/status` and sending the final
`gracePeriodSeconds=0` DELETE, for pods bound to `node-1`, a Node object with no kubelet behind
it (registered so that the pod garbage collector does not force-delete pods of a missing node,
and too small for the scheduler to place anything on). As on any cluster, deleting a scheduled
pod only marks it terminating, and an unscheduled one goes at once. The real controller manager
runs: its Deployment controller and garbage collector act here, so the tests poll for what they
do. `kubectl logs` through a real kubelet is in test_local_node.py.
"""

from __future__ import annotations

import copy
import datetime
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from admin_client import MERGE
from control_plane import ControlPlane
from e2e_support import parse_table, wait_until

pytestmark = pytest.mark.e2e
PODS = "/api/v1/namespaces/default/pods"
CONTAINER = {"name": "c", "image": "busybox"}


def pod(name: str, node: str | None = "node-1", **spec: Any) -> dict[str, Any]:
    """A one-container pod manifest, scheduled on `node` unless None."""
    body: dict[str, Any] = {"containers": [CONTAINER], **spec}
    if node is not None:
        body["nodeName"] = node
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": body}


def apply(api: ControlPlane, folder: Path, *manifests: dict[str, Any]) -> None:
    """kubectl apply -f of a multi-document file."""
    path = folder / "manifests.yaml"
    path.write_text(yaml.safe_dump_all(manifests))
    api.kubectl("apply", "-f", str(path))


def container(ready: bool, restarts: int = 0, **state: Any) -> dict[str, Any]:
    """One containerStatuses entry."""
    return {"name": "c", "ready": ready, "restartCount": restarts, **state}


STATUSES = {  # pod -> what a kubelet reports
    "running": {
        "phase": "Running",
        "podIP": "10.88.0.5",
        "conditions": [{"type": "Ready", "status": "True"}],
        "containerStatuses": [container(True, state={"running": {}})],
    },
    "crashing": {
        "phase": "Running",
        "containerStatuses": [
            container(
                False,
                3,
                state={"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s"}},
                lastState={"terminated": {"exitCode": 1, "reason": "Error", "finishedAt": ""}},
            )
        ],
    },
    "stopping": {"phase": "Running", "containerStatuses": [container(True, state={"running": {}})]},
    "creating": {
        "phase": "Pending",
        "containerStatuses": [container(False, state={"waiting": {"reason": "ContainerCreating"}})],
    },
    "done": {
        "phase": "Succeeded",
        "containerStatuses": [
            container(False, state={"terminated": {"exitCode": 0, "reason": "Completed"}})
        ],
    },
    "failed": {
        "phase": "Failed",
        "containerStatuses": [
            container(False, state={"terminated": {"exitCode": 2, "reason": "Error"}})
        ],
    },
}


DAYS_AGO = 3  # how long ago a past event was: kubectl prints "3d" however slow the test runs


def days_ago(days: int) -> str:
    """A timestamp `days` days ago, as the kubelet and event recorders write them."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - days * 86400))


def parse_time(stamp: str) -> float:
    """Seconds since the epoch of an RFC 3339 timestamp ("2026-01-01T00:00:00Z")."""
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def register_node(api: ControlPlane, name: str = "node-1") -> None:
    """A Node object with no kubelet (see the module docstring)."""
    api.request("POST", "/api/v1/nodes", {"metadata": {"name": name}}, expect=201)


def test_get_pods_shows_what_the_kubelet_reports(api_server: ControlPlane, tmp_path: Path) -> None:
    register_node(api_server)
    apply(api_server, tmp_path, *(pod(name) for name in STATUSES), pod("waiting", node=None))
    statuses = copy.deepcopy(STATUSES)
    terminated = statuses["crashing"]["containerStatuses"][0]["lastState"]["terminated"]
    terminated["finishedAt"] = days_ago(DAYS_AGO)
    for name, status in statuses.items():
        api_server.patch_status("v1/pods", "default", name, status)
    api_server.kubectl("delete", "pod", "stopping", "--wait=false")

    rows = {r["NAME"]: r for r in parse_table(api_server.kubectl("get", "pods").stdout)}
    assert list(rows["running"]) == ["NAME", "READY", "STATUS", "RESTARTS", "AGE"]
    shown = {name: (r["READY"], r["STATUS"], r["RESTARTS"]) for name, r in rows.items()}
    assert shown == {
        "running": ("1/1", "Running", "0"),
        "crashing": ("0/1", "CrashLoopBackOff", f"3 ({DAYS_AGO}d ago)"),
        "stopping": ("1/1", "Terminating", "0"),
        "creating": ("0/1", "ContainerCreating", "0"),
        "done": ("0/1", "Completed", "0"),
        "failed": ("0/1", "Error", "0"),
        "waiting": ("0/1", "Pending", "0"),  # no node can take it
    }

    wide = {r["NAME"]: r for r in parse_table(api_server.kubectl("get", "pods", "-o=wide").stdout)}
    assert (wide["running"]["IP"], wide["running"]["NODE"]) == ("10.88.0.5", "node-1")
    assert (wide["waiting"]["IP"], wide["waiting"]["NODE"]) == ("<none>", "<none>")
    assert wide["running"]["NOMINATED NODE"] == wide["running"]["READINESS GATES"] == "<none>"
    [one] = parse_table(api_server.kubectl("get", "pod", "crashing").stdout)
    assert one["STATUS"] == "CrashLoopBackOff"


def _deployment(api: ControlPlane) -> dict[str, Any]:
    found = api.obj("apps/v1/deployments", "default", "web")
    assert found is not None, "deployment web is gone"
    return found


def test_get_deployments_shows_replica_counts(api_server: ControlPlane, tmp_path: Path) -> None:
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web"},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {"metadata": {"labels": {"app": "web"}}, "spec": {"containers": []}},
        },
    }
    deployment["spec"]["template"]["spec"]["containers"] = [CONTAINER, {"name": "s", "image": "x"}]
    apply(api_server, tmp_path, deployment)
    # The Deployment controller makes a ReplicaSet and it two pods, which no kubelet runs.
    wait_until(
        lambda: (_deployment(api_server).get("status") or {}).get("updatedReplicas") == 2,
        120,
        interval=0.5,
        what="the Deployment controller's status",
    )
    [row] = parse_table(api_server.kubectl("get", "deployments", "-o=wide").stdout)
    assert row | {"AGE": ""} == {
        "NAME": "web",
        "READY": "0/2",
        "UP-TO-DATE": "2",
        "AVAILABLE": "0",
        "AGE": "",
        "CONTAINERS": "c,s",
        "IMAGES": "busybox,x",
        "SELECTOR": "app=web",
    }
    # a re-apply is a strategic merge patch: containers merge by name
    deployment["spec"]["template"]["spec"]["containers"][0] = {**CONTAINER, "image": "busybox:2"}
    apply(api_server, tmp_path, deployment)
    [row] = parse_table(api_server.kubectl("get", "deploy", "-o=wide").stdout)
    assert row["IMAGES"] == "busybox:2,x"

    # and the controller rolls it out as a second ReplicaSet with the new template
    def images() -> set[tuple[str, ...]]:
        sets = api_server.objs("apps/v1/replicasets", "default", "app=web")
        return {
            tuple(c["image"] for c in rs["spec"]["template"]["spec"]["containers"]) for rs in sets
        }

    wait_until(
        lambda: images() == {("busybox", "x"), ("busybox:2", "x")},
        120,
        interval=0.5,
        what="the new ReplicaSet",
    )


def _stored(api: ControlPlane, name: str) -> dict[str, Any] | None:
    return api.obj("v1/pods", "default", name)


def _meta(api: ControlPlane, name: str) -> dict[str, Any]:
    obj = _stored(api, name)
    assert obj is not None, f"pod {name} is gone"
    return obj["metadata"]  # type: ignore[no-any-return]


def test_pods_terminate_gracefully_until_the_kubelet_deletes_them(
    api_server: ControlPlane, tmp_path: Path
) -> None:
    register_node(api_server)
    held = pod("held")
    held["metadata"]["finalizers"] = ["example.com/hold"]
    manifests = [
        pod("slow", terminationGracePeriodSeconds=45),
        pod("quick"),
        pod("unscheduled", None),
    ]
    apply(api_server, tmp_path, *manifests, pod("plain"), held)

    api_server.kubectl("delete", "pod", "unscheduled", timeout=60)  # never scheduled: goes at once
    assert _stored(api_server, "unscheduled") is None

    before = time.time()
    api_server.kubectl("delete", "pod", "slow", "--wait=false")
    meta = _meta(api_server, "slow")
    assert meta["deletionGracePeriodSeconds"] == 45  # the pod's terminationGracePeriodSeconds
    assert before + 44 <= parse_time(meta["deletionTimestamp"]) <= time.time() + 46
    api_server.kubectl("delete", "pod", "plain", "--wait=false")
    assert _meta(api_server, "plain")["deletionGracePeriodSeconds"] == 30  # the default
    api_server.kubectl("delete", "pod", "quick", "--grace-period=7", "--wait=false")
    assert _meta(api_server, "quick")["deletionGracePeriodSeconds"] == 7  # DeleteOptions
    [row] = [
        r for r in parse_table(api_server.kubectl("get", "pods").stdout) if r["NAME"] == "slow"
    ]
    assert row["STATUS"] == "Terminating"

    api_server.request("DELETE", f"{PODS}/slow", expect=200)  # no grace given: nothing changes
    api_server.request("DELETE", f"{PODS}/slow", {"gracePeriodSeconds": 60}, expect=200)
    assert _meta(api_server, "slow")["deletionGracePeriodSeconds"] == 45  # never lengthened
    api_server.request("DELETE", f"{PODS}/slow", {"gracePeriodSeconds": 10}, expect=200)
    assert _meta(api_server, "slow")["deletionGracePeriodSeconds"] == 10  # but shortened

    stale = {"gracePeriodSeconds": 0, "preconditions": {"uid": "another-pod"}}
    _, answer = api_server.request("DELETE", f"{PODS}/slow", stale, expect=409)
    assert answer["reason"] == "Conflict"
    assert "the UID in the precondition (another-pod) does not match" in answer["message"]
    final = {"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}}
    api_server.request("DELETE", f"{PODS}/slow", final, expect=200)  # the kubelet's delete
    assert _stored(api_server, "slow") is None
    api_server.request("DELETE", f"{PODS}/quick?gracePeriodSeconds=0", expect=200)  # as a query
    assert _stored(api_server, "quick") is None

    api_server.kubectl("delete", "pod", "held", "--wait=false")
    api_server.request("DELETE", f"{PODS}/held?gracePeriodSeconds=0", expect=200)
    assert _meta(api_server, "held")["deletionGracePeriodSeconds"] == 0  # the finalizer holds it
    unhold = {"metadata": {"finalizers": None}}
    api_server.request("PATCH", f"{PODS}/held", unhold, content_type=MERGE, expect=200)
    assert _stored(api_server, "held") is None


def _owned(name: str, owner: dict[str, Any], node: str | None = "node-1") -> dict[str, Any]:
    body = pod(name, node)
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": owner["metadata"]["name"]}
    body["metadata"]["ownerReferences"] = [{**ref, "uid": owner["metadata"]["uid"]}]
    return body


def test_garbage_collection_deletes_owned_pods_gracefully(api_server: ControlPlane) -> None:
    register_node(api_server)
    owners = {}
    for name in ("owner", "parent"):
        cm = {"metadata": {"name": name}, "data": {}}
        _, owners[name] = api_server.request(
            "POST", "/api/v1/namespaces/default/configmaps", cm, expect=201
        )
    for body in (
        _owned("scheduled", owners["owner"]),
        _owned("unscheduled", owners["owner"], node=None),
        _owned("kept", owners["parent"]),
    ):
        api_server.request("POST", PODS, body, expect=201)

    # The controller manager's garbage collector deletes the dependents after their owner.
    api_server.kubectl("delete", "configmap", "owner")
    wait_until(
        lambda: (
            _stored(api_server, "unscheduled") is None
            and _meta(api_server, "scheduled").get("deletionTimestamp")
        ),
        120,
        interval=0.5,
        what="the garbage collector deleting the owner's pods",
    )
    assert _meta(api_server, "scheduled")["deletionGracePeriodSeconds"] == 30

    # kubectl waits for the orphan finalizer, which the collector removes once it has taken the
    # owner reference off every dependent
    api_server.kubectl("delete", "configmap", "parent", "--cascade=orphan", timeout=180)
    assert not _meta(api_server, "kept").get("ownerReferences")  # orphaned, not deleted
    assert not _meta(api_server, "kept").get("deletionTimestamp")

    # an object whose owners are all gone already is garbage from the start
    api_server.request("POST", PODS, _owned("late", owners["owner"], node=None), expect=201)
    wait_until(
        lambda: _stored(api_server, "late") is None,
        120,
        interval=0.5,
        what="the garbage collector deleting a pod of a deleted owner",
    )


def test_scheduling_field_selectors_and_events(api_server: ControlPlane) -> None:
    register_node(api_server)
    for body in (pod("placed"), pod("unplaced", node=None)):
        api_server.request("POST", PODS, body, expect=201)

    def names(*args: str) -> list[str]:
        return [r["NAME"] for r in parse_table(api_server.kubectl("get", "pods", *args).stdout)]

    assert names("--field-selector=spec.nodeName=node-1") == ["placed"]
    assert names("--field-selector=spec.nodeName=") == ["unplaced"]  # what a scheduler watches
    binding = {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {"name": "unplaced"},
        "target": {"kind": "Node", "name": "node-1"},
    }
    api_server.request("POST", f"{PODS}/unplaced/binding", binding, expect=201)
    placed = _stored(api_server, "unplaced")
    assert placed is not None and placed["spec"]["nodeName"] == "node-1"
    [scheduled] = [c for c in placed["status"]["conditions"] if c["type"] == "PodScheduled"]
    assert scheduled["status"] == "True"
    _, answer = api_server.request("POST", f"{PODS}/unplaced/binding", binding, expect=409)
    assert 'pod unplaced is already assigned to node "node-1"' in answer["message"]
    assert names("--field-selector=spec.nodeName=node-1") == ["placed", "unplaced"]

    event = {
        "metadata": {"generateName": "smollm2-"},
        "involvedObject": {"kind": "InferenceEngine", "name": "smollm2", "namespace": "default"},
        "type": "Warning",
        "reason": "RankFailed",
        "message": "rank 1 failed: OOMKilled ",
        "lastTimestamp": days_ago(DAYS_AGO),
        "count": 2,
    }
    api_server.request("POST", "/api/v1/namespaces/default/events", event, expect=201)
    # the cluster's own events (the node's registration, scheduling failures) are listed too
    rows = parse_table(api_server.kubectl("get", "events").stdout)
    [row] = [r for r in rows if r["REASON"] == "RankFailed"]
    assert row == {
        "LAST SEEN": f"{DAYS_AGO}d",
        "TYPE": "Warning",
        "REASON": "RankFailed",
        "OBJECT": "inferenceengine/smollm2",
        "MESSAGE": "rank 1 failed: OOMKilled",
    }
