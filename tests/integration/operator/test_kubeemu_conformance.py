"""The emulator against the real kube-apiserver's behaviour, one API convention per test.

Each test talks HTTP to a served `KubeEmu`, as a client of a real server would, and checks what
kube-apiserver (v1.36) does; docs/local-cluster.md lists the conventions and these tests.
"""

from __future__ import annotations

import json
import pathlib
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml
from kubeemu import KubeEmu
from kubeemu_server import ServedInThread

REPO = pathlib.Path(__file__).resolve().parents[3]
IE_CRD = yaml.safe_load((REPO / "crds" / "inferenceengines.corefleet.dev.yaml").read_text())
CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
IES = "/apis/corefleet.dev/v1alpha1/namespaces/default/inferenceengines"
CMS = "/api/v1/namespaces/default/configmaps"
DEPLOYS = "/apis/apps/v1/namespaces/default/deployments"
PEERINGS = "/apis/kopf.dev/v1/clusterkopfpeerings"
MERGE = "application/merge-patch+json"
UNKNOWN = "the server could not find the requested resource"


def peering_crd(**meta: Any) -> dict[str, Any]:
    """kopf's ClusterKopfPeering CRD, as crds/kopf-peering.yaml declares it."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "clusterkopfpeerings.kopf.dev", **meta},
        "spec": {
            "group": "kopf.dev",
            "scope": "Cluster",
            "names": {"kind": "ClusterKopfPeering", "plural": "clusterkopfpeerings"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": {"type": "object"}},
                }
            ],
        },
    }


class Api:
    """A served emulator and a minimal HTTP client for it."""

    def __init__(self, emu: KubeEmu, url: str) -> None:
        self.emu, self.url = emu, url

    def __call__(
        self, method: str, path: str, body: Any = None, ctype: str = "application/json"
    ) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": ctype}
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as err:
            status, raw = err.code, err.read()
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw.decode()  # a watch: JSON lines

    def ok(self, method: str, path: str, body: Any = None, ctype: str = MERGE) -> Any:
        status, answer = self(method, path, body, "application/json" if method == "POST" else ctype)
        assert status < 300, (method, path, status, answer)
        return answer

    def events(self, path: str) -> list[dict[str, Any]]:
        """The lines of a watch that the server ends (timeoutSeconds in `path`)."""
        status, text = self("GET", path)
        assert status == 200, text  # a watch's errors are events of its stream
        text = text if isinstance(text, str) else json.dumps(text)
        return [json.loads(line) for line in text.splitlines() if line.strip()]


def serve(**options: Any) -> Iterator[Api]:
    emu = KubeEmu(**options)
    with ServedInThread(emu) as url:
        api = Api(emu, url)
        api.ok("POST", "/api/v1/namespaces", {"metadata": {"name": "default"}})
        api.ok("POST", CRDS, IE_CRD)
        yield api


@pytest.fixture
def api() -> Iterator[Api]:
    yield from serve()


def eventually(check: Callable[[], Any], timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (result := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {check}"
        time.sleep(0.02)
    return result


def engine(name: str = "llama", **meta: Any) -> dict[str, Any]:
    spec = {"image": "corefleet:test", "model": {"path": "/m"}, "dataParallelSize": 1}
    return {"metadata": {"name": name, **meta}, "spec": spec}


def cm(name: str, **meta: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, **meta}, "data": {"a": "1"}}


# --- CRDs: a kind is served once its CRD is established, and no longer once it is deleted


def test_a_kind_no_established_crd_defines_is_not_found(api: Api) -> None:
    for method, path in [("GET", PEERINGS), ("GET", f"{PEERINGS}/x"), ("POST", PEERINGS)]:
        status, answer = api(
            method, path, {"metadata": {"name": "x"}} if method == "POST" else None
        )
        assert (status, answer["reason"], answer["message"]) == (404, "NotFound", UNKNOWN)
    assert api("GET", "/apis/kopf.dev/v1")[0] == 404
    assert "kopf.dev" not in {g["name"] for g in api.ok("GET", "/apis")["groups"]}
    crd = api.ok("POST", CRDS, peering_crd())
    conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert conditions == {"NamesAccepted": "True", "Established": "True"}
    assert crd["status"]["acceptedNames"]["listKind"] == "ClusterKopfPeeringList"
    status, missing = api("GET", f"{PEERINGS}/corefleet-operator")  # kopf's peering lookup
    assert (status, missing["message"]) == (
        404,
        'clusterkopfpeerings.kopf.dev "corefleet-operator" not found',
    )
    assert "kopf.dev" in {g["name"] for g in api.ok("GET", "/apis")["groups"]}
    api.ok("POST", PEERINGS, {"metadata": {"name": "corefleet-operator"}})


def test_a_crd_is_served_only_once_established() -> None:
    for api in serve(crd_establish_seconds=0.3):
        created = api.ok("POST", CRDS, peering_crd())
        assert created["status"]["conditions"] == []
        status, answer = api("POST", PEERINGS, {"metadata": {"name": "early"}})
        assert (status, answer["message"]) == (404, UNKNOWN)

        def established(api: Api = api) -> bool:
            crd = api.ok("GET", f"{CRDS}/clusterkopfpeerings.kopf.dev")
            return any(c["type"] == "Established" for c in crd["status"]["conditions"])

        eventually(established)
        api.ok("POST", PEERINGS, {"metadata": {"name": "late"}})


def test_a_crd_name_must_be_plural_dot_group(api: Api) -> None:
    status, answer = api("POST", CRDS, peering_crd(name="peerings.kopf.dev"))
    assert (status, answer["reason"]) == (422, "Invalid")


def test_deleting_a_crd_deletes_its_objects_then_stops_serving_the_kind(api: Api) -> None:
    api.ok("POST", IES, engine(finalizers=["test/hold"]))
    crd = api.ok("DELETE", f"{CRDS}/inferenceengines.corefleet.dev")
    assert "customresourcecleanup.apiextensions.k8s.io" in crd["metadata"]["finalizers"]
    assert any(c["type"] == "Terminating" for c in crd["status"]["conditions"])
    assert api.ok("GET", f"{IES}/llama")["metadata"]["deletionTimestamp"]
    assert api("POST", IES, engine("other"))[0] == 405
    api.ok("PATCH", f"{IES}/llama", {"metadata": {"finalizers": None}})
    assert api("GET", f"{CRDS}/inferenceengines.corefleet.dev")[0] == 404
    assert api("GET", IES)[1]["message"] == UNKNOWN


# --- writes: generation, subresources, resourceVersion, patch types, finalizers


def test_generation_counts_spec_changes_and_the_deletion_only(api: Api) -> None:
    def generation() -> int:
        return int(api.ok("GET", f"{IES}/llama")["metadata"]["generation"])

    api.ok("POST", IES, engine())
    api.ok("PATCH", f"{IES}/llama", {"metadata": {"labels": {"a": "b"}}})
    api.ok("PATCH", f"{IES}/llama/status", {"status": {"phase": "Ready"}})
    assert generation() == 1
    api.ok("PATCH", f"{IES}/llama", {"spec": {"dataParallelSize": 2}})
    assert generation() == 2
    api.ok("PATCH", f"{IES}/llama", {"metadata": {"finalizers": ["test/hold"]}})
    api.ok("DELETE", f"{IES}/llama")
    assert generation() == 3  # deletionTimestamp set


def test_status_and_main_writes_ignore_each_others_fields(api: Api) -> None:
    api.ok("POST", IES, {**engine(), "status": {"phase": "Made up"}})
    assert "status" not in api.ok("GET", f"{IES}/llama")
    body = {"metadata": {"labels": {"x": "y"}}, "spec": {"dataParallelSize": 5}}
    api.ok("PATCH", f"{IES}/llama/status", {**body, "status": {"phase": "Ready"}})
    api.ok("PATCH", f"{IES}/llama", {"status": {"phase": "Other"}})
    obj = api.ok("GET", f"{IES}/llama")
    assert obj["status"] == {"phase": "Ready"}
    assert obj["spec"]["dataParallelSize"] == 1 and "labels" not in obj["metadata"]


def test_the_scale_subresource(api: Api) -> None:
    api.ok("POST", IES, engine())
    scale = api.ok("GET", f"{IES}/llama/scale")
    assert (scale["apiVersion"], scale["kind"], scale["spec"]) == (
        "autoscaling/v1",
        "Scale",
        {"replicas": 1},
    )
    stale = {"metadata": {"resourceVersion": "1"}, "spec": {"replicas": 3}}
    assert api("PATCH", f"{IES}/llama/scale", stale, MERGE)[0] == 409
    api.ok("PATCH", f"{IES}/llama/scale", {"spec": {"replicas": 3}})
    obj = api.ok("GET", f"{IES}/llama")
    assert (obj["spec"]["dataParallelSize"], obj["metadata"]["generation"]) == (3, 2)


def test_a_deployment_defaults_replicas_and_its_scale_owns_them(api: Api) -> None:
    # SetDefaults_Deployment: no replicas is 1. An HPA then writes /scale, and a merge patch
    # that leaves replicas out (the operator's, for an autoscaled Deployment) keeps its value.
    template = {"metadata": {"labels": {"app": "d"}}, "spec": {"containers": []}}
    body = {"metadata": {"name": "d"}, "spec": {"template": template}}
    assert api.ok("POST", DEPLOYS, body)["spec"]["replicas"] == 1
    scale = api.ok("GET", f"{DEPLOYS}/d/scale")
    assert (scale["kind"], scale["spec"]) == ("Scale", {"replicas": 1})
    api.ok("PATCH", f"{DEPLOYS}/d/scale", {"spec": {"replicas": 3}})
    patch = {"spec": {"strategy": {"type": "RollingUpdate"}}}
    assert api.ok("PATCH", f"{DEPLOYS}/d", patch)["spec"]["replicas"] == 3
    assert api.ok("PATCH", f"{DEPLOYS}/d", {"spec": {"replicas": None}})["spec"]["replicas"] == 1
    hpas = "/apis/autoscaling/v2/namespaces/default/horizontalpodautoscalers"
    ref = {"apiVersion": "apps/v1", "kind": "Deployment", "name": "d"}
    hpa = {"metadata": {"name": "d"}, "spec": {"scaleTargetRef": ref, "maxReplicas": 4}}
    assert api.ok("POST", hpas, hpa)["kind"] == "HorizontalPodAutoscaler"
    assert [o["metadata"]["name"] for o in api.ok("GET", hpas)["items"]] == ["d"]


def test_stale_or_missing_resource_versions(api: Api) -> None:
    obj = api.ok("POST", IES, engine())
    api.ok("PATCH", f"{IES}/llama", {"metadata": {"labels": {"a": "b"}}})
    status, answer = api("PUT", f"{IES}/llama", obj)  # obj holds the old resourceVersion
    assert (status, answer["reason"]) == (409, "Conflict")
    stale = {"metadata": {"resourceVersion": obj["metadata"]["resourceVersion"]}}
    assert api("PATCH", f"{IES}/llama", stale, MERGE)[0] == 409
    del obj["metadata"]["resourceVersion"]
    status, answer = api("PUT", f"{IES}/llama", obj)
    assert (status, answer["reason"]) == (422, "Invalid")  # custom resources: no blind update


def test_patch_types(api: Api) -> None:
    api.ok("POST", IES, engine(labels={"a": "1", "b": "2"}))
    api.ok("PATCH", f"{IES}/llama", {"metadata": {"labels": {"a": None}}})
    ops = [{"op": "replace", "path": "/spec/dataParallelSize", "value": 4}]
    obj = api.ok("PATCH", f"{IES}/llama", ops, "application/json-patch+json")
    assert obj["metadata"]["labels"] == {"b": "2"} and obj["spec"]["dataParallelSize"] == 4
    strategic = "application/strategic-merge-patch+json"
    status, answer = api("PATCH", f"{IES}/llama", {"spec": {}}, strategic)
    assert (status, answer["reason"]) == (415, "UnsupportedMediaType")
    containers = [{"name": "a", "image": "x"}, {"name": "b", "image": "y"}]
    template = {"metadata": {"labels": {"app": "d"}}, "spec": {"containers": containers}}
    api.ok("POST", DEPLOYS, {"metadata": {"name": "d"}, "spec": {"template": template}})
    patch = {"spec": {"template": {"spec": {"containers": [{"name": "b", "image": "z"}]}}}}
    deploy = api.ok("PATCH", f"{DEPLOYS}/d", patch, strategic)
    images = [c["image"] for c in deploy["spec"]["template"]["spec"]["containers"]]
    assert images == ["x", "z"]  # merged by name


def test_label_selectors(api: Api) -> None:
    for name, labels in [("one", {"tier": "a", "x": "1"}), ("two", {"tier": "b"}), ("three", {})]:
        api.ok("POST", CMS, cm(name, labels=labels))

    def names(selector: str) -> set[str]:
        query = urllib.request.quote(selector)
        return {
            o["metadata"]["name"] for o in api.ok("GET", f"{CMS}?labelSelector={query}")["items"]
        }

    assert names("tier in (a,b)") == {"one", "two"}
    assert names("tier notin (a)") == {"two", "three"}  # a missing label is not in the set
    assert names("!x") == {"two", "three"} and names("x") == {"one"}
    assert names("tier!=a") == {"two", "three"} and names("tier=a,x==1") == {"one"}


def test_finalizers_hold_a_deleted_object_and_cannot_be_added_then(api: Api) -> None:
    api.ok("POST", CMS, cm("held", finalizers=["test/a"]))
    deleted = api.ok("DELETE", f"{CMS}/held")
    assert deleted["metadata"]["deletionTimestamp"]
    assert deleted["metadata"]["deletionGracePeriodSeconds"] == 0
    more = {"metadata": {"finalizers": ["test/a", "test/b"]}}
    status, answer = api("PATCH", f"{CMS}/held", more, MERGE)
    assert (status, answer["reason"]) == (422, "Invalid") and "no new finalizers" in answer[
        "message"
    ]
    api.ok("PATCH", f"{CMS}/held", {"metadata": {"finalizers": None}})
    assert api("GET", f"{CMS}/held")[0] == 404


# --- watches


def test_watch_bookmarks_only_when_allowed() -> None:
    for api in serve(bookmark_seconds=0.05):
        api.ok("POST", CMS, cm("a"))
        rv = api.ok("GET", CMS)["metadata"]["resourceVersion"]
        marks = api.events(
            f"{CMS}?watch=1&resourceVersion={rv}&allowWatchBookmarks=true&timeoutSeconds=1"
        )
        assert marks and {e["type"] for e in marks} == {"BOOKMARK"}
        assert marks[0]["object"] == {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"resourceVersion": rv},
        }
        assert api.events(f"{CMS}?watch=1&resourceVersion={rv}&timeoutSeconds=1") == []


def test_watch_from_a_compacted_resource_version_gets_410_in_the_stream() -> None:
    for api in serve(history_size=2):
        for i in range(4):
            api.ok("POST", CMS, cm(f"c{i}"))
        (event,) = api.events(f"{CMS}?watch=1&resourceVersion=1&timeoutSeconds=1")
        assert event["type"] == "ERROR"
        assert (event["object"]["kind"], event["object"]["code"]) == ("Status", 410)
        assert event["object"]["reason"] == "Expired"
        assert event["object"]["message"].startswith("too old resource version: 1")


# --- garbage collection


def owned(name: str, owner: dict[str, Any], block: bool, finalizer: str) -> dict[str, Any]:
    ref = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"],
        "blockOwnerDeletion": block,
    }
    return cm(name, ownerReferences=[ref], finalizers=[finalizer])


def test_background_and_orphan_deletion(api: Api) -> None:
    owner = api.ok("POST", CMS, cm("owner"))
    api.ok("POST", CMS, owned("dep", owner, False, "test/x"))
    api.ok("PATCH", f"{CMS}/dep", {"metadata": {"finalizers": None}})
    api.ok("DELETE", f"{CMS}/owner")  # Background: the owner goes first, then the dependent
    assert api("GET", f"{CMS}/dep")[0] == 404
    owner = api.ok("POST", CMS, cm("owner2"))
    api.ok("POST", CMS, owned("dep2", owner, True, "test/x"))
    api.ok("DELETE", f"{CMS}/owner2", {"propagationPolicy": "Orphan"}, "application/json")
    assert api.ok("GET", f"{CMS}/dep2")["metadata"].get("ownerReferences") is None


def test_foreground_deletion_waits_for_blocking_dependents(api: Api) -> None:
    owner = api.ok("POST", CMS, cm("owner"))
    api.ok("POST", CMS, owned("blocking", owner, True, "test/a"))
    api.ok("POST", CMS, owned("free", owner, False, "test/b"))
    body = {"propagationPolicy": "Foreground"}
    deleted = api.ok("DELETE", f"{CMS}/owner", body, "application/json")
    assert deleted["metadata"]["finalizers"] == ["foregroundDeletion"]
    assert deleted["metadata"]["deletionTimestamp"]
    for name in ("blocking", "free"):  # the dependents are deleted before the owner
        assert api.ok("GET", f"{CMS}/{name}")["metadata"]["deletionTimestamp"]
    api.ok("PATCH", f"{CMS}/free", {"metadata": {"finalizers": None}})
    assert api("GET", f"{CMS}/owner")[0] == 200  # "free" did not block it
    api.ok("PATCH", f"{CMS}/blocking", {"metadata": {"finalizers": None}})
    assert api("GET", f"{CMS}/owner")[0] == 404
