"""Pods and Deployments through the real kubectl: the tables kubectl prints, graceful deletion.

The test plays the kubelet by PATCHing `pods/<name>/status` and sending the final
`gracePeriodSeconds=0` DELETE. The emulator runs with `kubelet_finalizes_pods=True`, as in the
e2e cluster: deleting a scheduled pod only marks it terminating.
"""

from __future__ import annotations

import copy
import re
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from apiserver import MERGE, ApiServer, parse_table
from kubeemu_table import parse_time

pytestmark = pytest.mark.e2e
PODS = "/api/v1/namespaces/default/pods"
CONTAINER = {"name": "c", "image": "busybox"}


def pod(name: str, node: str | None = "node-1", **spec: Any) -> dict[str, Any]:
    """A one-container pod manifest, scheduled on `node` unless None."""
    body: dict[str, Any] = {"containers": [CONTAINER], **spec}
    if node is not None:
        body["nodeName"] = node
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": body}


def apply(api: ApiServer, folder: Path, *manifests: dict[str, Any]) -> None:
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


def test_get_pods_shows_what_the_kubelet_reports(api_server: ApiServer, tmp_path: Path) -> None:
    apply(api_server, tmp_path, *(pod(name) for name in STATUSES), pod("waiting", node=None))
    statuses = copy.deepcopy(STATUSES)
    finished = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 150))
    statuses["crashing"]["containerStatuses"][0]["lastState"]["terminated"]["finishedAt"] = finished
    for name, status in statuses.items():
        api_server.patch_status("v1/pods", "default", name, status)
    api_server.kubectl("delete", "pod", "stopping", "--wait=false")

    rows = {r["NAME"]: r for r in parse_table(api_server.kubectl("get", "pods").stdout)}
    assert list(rows["running"]) == ["NAME", "READY", "STATUS", "RESTARTS", "AGE"]
    shown = {name: (r["READY"], r["STATUS"], r["RESTARTS"]) for name, r in rows.items()}
    assert re.fullmatch(r"3 \(2m3\ds ago\)", shown["crashing"][2]), shown["crashing"]
    assert shown | {"crashing": None} == {
        "running": ("1/1", "Running", "0"),
        "crashing": None,
        "stopping": ("1/1", "Terminating", "0"),
        "creating": ("0/1", "ContainerCreating", "0"),
        "done": ("0/1", "Completed", "0"),
        "failed": ("0/1", "Error", "0"),
        "waiting": ("0/1", "Pending", "0"),
    }
    assert shown["crashing"][:2] == ("0/1", "CrashLoopBackOff")

    wide = {r["NAME"]: r for r in parse_table(api_server.kubectl("get", "pods", "-o=wide").stdout)}
    assert (wide["running"]["IP"], wide["running"]["NODE"]) == ("10.88.0.5", "node-1")
    assert (wide["waiting"]["IP"], wide["waiting"]["NODE"]) == ("<none>", "<none>")
    assert wide["running"]["NOMINATED NODE"] == wide["running"]["READINESS GATES"] == "<none>"
    [one] = parse_table(api_server.kubectl("get", "pod", "crashing").stdout)
    assert one["STATUS"] == "CrashLoopBackOff"


def test_get_deployments_shows_replica_counts(api_server: ApiServer, tmp_path: Path) -> None:
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
    status = {"replicas": 2, "readyReplicas": 1, "updatedReplicas": 2, "availableReplicas": 1}
    api_server.patch_status("apps/v1/deployments", "default", "web", status)
    [row] = parse_table(api_server.kubectl("get", "deployments", "-o=wide").stdout)
    assert row | {"AGE": ""} == {
        "NAME": "web",
        "READY": "1/2",
        "UP-TO-DATE": "2",
        "AVAILABLE": "1",
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


def _stored(api: ApiServer, name: str) -> dict[str, Any] | None:
    return api.emu.obj("v1/pods", "default", name)


def _meta(api: ApiServer, name: str) -> dict[str, Any]:
    obj = _stored(api, name)
    assert obj is not None, f"pod {name} is gone"
    return obj["metadata"]  # type: ignore[no-any-return]


def test_pods_terminate_gracefully_until_the_kubelet_deletes_them(
    api_server: ApiServer, tmp_path: Path
) -> None:
    held = pod("held")
    held["metadata"]["finalizers"] = ["example.com/hold"]
    manifests = [
        pod("slow", terminationGracePeriodSeconds=45),
        pod("quick"),
        pod("unscheduled", None),
    ]
    apply(api_server, tmp_path, *manifests, pod("plain"), held)

    api_server.kubectl("delete", "pod", "unscheduled", timeout=10)  # never scheduled: goes at once
    assert _stored(api_server, "unscheduled") is None

    before = time.time()
    api_server.kubectl("delete", "pod", "slow", "--wait=false")
    meta = _meta(api_server, "slow")
    assert meta["deletionGracePeriodSeconds"] == 45  # the pod's terminationGracePeriodSeconds
    assert before + 44 <= (parse_time(meta["deletionTimestamp"]) or 0) <= time.time() + 46
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
    assert answer["reason"] == "Conflict" and "Precondition failed" in answer["message"]
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


def test_garbage_collection_deletes_owned_pods_gracefully(api_server: ApiServer) -> None:
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

    api_server.kubectl("delete", "configmap", "owner")
    assert _stored(api_server, "unscheduled") is None
    assert _meta(api_server, "scheduled")["deletionGracePeriodSeconds"] == 30

    api_server.kubectl("delete", "configmap", "parent", "--cascade=orphan")
    assert not _meta(api_server, "kept").get("ownerReferences")  # orphaned, not deleted
    assert not _meta(api_server, "kept").get("deletionTimestamp")

    # an object whose owners are all gone already is garbage from the start
    api_server.request("POST", PODS, _owned("late", owners["owner"], node=None), expect=201)
    assert _stored(api_server, "late") is None


def test_scheduling_field_selectors_logs_and_events(api_server: ApiServer) -> None:
    for body in (pod("placed"), pod("unplaced", node=None)):
        api_server.request("POST", PODS, body, expect=201)

    def names(*args: str) -> list[str]:
        return [r["NAME"] for r in parse_table(api_server.kubectl("get", "pods", *args).stdout)]

    assert names("--field-selector=spec.nodeName=node-1") == ["placed"]
    assert names("--field-selector=spec.nodeName=") == ["unplaced"]  # what a scheduler watches
    binding = {"apiVersion": "v1", "kind": "Binding", "target": {"kind": "Node", "name": "n2"}}
    api_server.request("POST", f"{PODS}/unplaced/binding", binding, expect=201)
    placed = api_server.emu.obj("v1/pods", "default", "unplaced")
    assert placed is not None and placed["spec"]["nodeName"] == "n2"
    assert placed["status"]["conditions"][-1] | {"lastTransitionTime": ""} == {
        "type": "PodScheduled",
        "status": "True",
        "lastTransitionTime": "",
    }
    _, answer = api_server.request("POST", f"{PODS}/unplaced/binding", binding, expect=409)
    assert "already assigned" in answer["message"]

    missing = api_server.kubectl("logs", "placed", check=False)
    assert missing.returncode == 1 and "no logs" in missing.stderr
    logs = {("default", "placed", "c"): "starting\nserving\n"}
    api_server.emu.pod_logs = lambda ns, name, container: logs.get((ns, name, container or "c"))
    assert api_server.kubectl("logs", "placed").stdout == "starting\nserving\n"
    assert api_server.kubectl("logs", "placed", "-c", "c", "--tail=1").stdout == "serving\n"

    event = {
        "metadata": {"generateName": "smollm2-"},
        "involvedObject": {"kind": "InferenceEngine", "name": "smollm2", "namespace": "default"},
        "type": "Warning",
        "reason": "RankFailed",
        "message": "rank 1 failed: OOMKilled ",
        "lastTimestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 65)),
        "count": 2,
    }
    api_server.request("POST", "/api/v1/namespaces/default/events", event, expect=201)
    [row] = parse_table(api_server.kubectl("get", "events").stdout)
    assert row | {"LAST SEEN": ""} == {
        "LAST SEEN": "",
        "TYPE": "Warning",
        "REASON": "RankFailed",
        "OBJECT": "inferenceengine/smollm2",
        "MESSAGE": "rank 1 failed: OOMKilled",
    }
    assert row["LAST SEEN"] in ("65s", "66s", "67s")
