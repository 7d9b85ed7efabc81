"""What a real kube-apiserver refuses, and how: `v1 Status` answers, and what kubectl prints.

Malformed or conflicting requests get a Status with the HTTP code and reason a client acts on.
Invalid InferenceEngine specs are in test_crd_validation.py.

One control plane serves the whole module (the cases only read, or are refused); the watch-expiry
test starts its own, with the watch cache of ConfigMaps off so that etcd's compaction shows.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from admin_client import MERGE
from control_plane import ControlPlane
from e2e_support import REPO

pytestmark = pytest.mark.e2e
EXAMPLE = REPO / "examples" / "smollm2-cpu.yaml"
IE = "corefleet.dev/v1alpha1/inferenceengines"
IE_URL = "/apis/corefleet.dev/v1alpha1/namespaces/default/inferenceengines"
PODS = "/api/v1/namespaces/default/pods"
CMS = "/api/v1/namespaces/default/configmaps"
JSON_PATCH = "application/json-patch+json"
PROTOBUF = "application/vnd.kubernetes.protobuf"


@pytest.fixture(scope="module")
def api(module_api_server: ControlPlane) -> ControlPlane:
    """One control plane for the module (the cases only read, or are refused)."""
    return module_api_server


def _cm(name: str, **meta: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, **meta}}


APPLY = "application/apply-patch+yaml"
CASES: list[tuple[str, str, Any, dict[str, str], int, str]] = [
    # (method, path, body, headers, HTTP code, reason)
    ("GET", f"{IE_URL}/nope", None, {}, 404, "NotFound"),
    ("POST", IE_URL, "the example again", {}, 409, "AlreadyExists"),
    ("POST", CMS, b"{not json", {}, 400, "BadRequest"),
    ("POST", CMS, [1, 2], {}, 400, "BadRequest"),
    ("POST", CMS, _cm("x", namespace="other"), {}, 400, "BadRequest"),
    (
        "POST",
        CMS,
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"}},
        {},
        400,
        "BadRequest",
    ),
    ("POST", CMS, _cm("Bad_Name"), {}, 422, "Invalid"),
    ("POST", CMS, {"metadata": {}}, {}, 422, "Invalid"),
    ("POST", f"{CMS}?dryRun=Bogus", _cm("x"), {}, 422, "Invalid"),
    ("POST", CMS, b"\x0a\x02", {"Content-Type": PROTOBUF}, 400, "BadRequest"),  # not a message
    ("POST", "/api/v1/namespaces/nope/configmaps", _cm("x"), {}, 404, "NotFound"),
    (
        "PATCH",
        f"{IE_URL}/smollm2",
        {"metadata": {"resourceVersion": "1"}},
        {"Content-Type": MERGE},
        409,
        "Conflict",
    ),
    (
        "PATCH",
        f"{IE_URL}/smollm2",
        [{"op": "test", "path": "/spec/dataParallelSize", "value": 9}],
        {"Content-Type": JSON_PATCH},
        422,
        "Invalid",
    ),
    (  # custom resources take no strategic merge patch: `kubectl patch ie` defaults to merge
        "PATCH",
        f"{IE_URL}/smollm2",
        {"spec": {"dataParallelSize": 3}},
        {"Content-Type": "application/strategic-merge-patch+json"},
        415,
        "UnsupportedMediaType",
    ),
    ("PATCH", f"{IE_URL}/smollm2", b"spec: {}", {"Content-Type": APPLY}, 422, "Invalid"),
    (  # server-side apply of a field kubectl's client-side apply owns
        "PATCH",
        f"{IE_URL}/smollm2?fieldManager=someone-else",
        b"apiVersion: corefleet.dev/v1alpha1\nkind: InferenceEngine\n"
        b"metadata: {name: smollm2}\nspec: {dataParallelSize: 3}\n",
        {"Content-Type": APPLY},
        409,
        "Conflict",
    ),
    (
        "PATCH",
        f"{IE_URL}/smollm2/scale",
        {"spec": {"replicas": "two"}},
        {"Content-Type": MERGE},
        422,
        "Invalid",
    ),
    (
        "PATCH",
        f"{IE_URL}/smollm2/scale",
        {"spec": {"replicas": 5000}},
        {"Content-Type": MERGE},
        422,
        "Invalid",
    ),
    ("GET", f"{IE_URL}/smollm2/logs", None, {}, 404, "NotFound"),
    ("GET", f"{PODS}?fieldSelector=nonsense", None, {}, 400, "BadRequest"),
    ("GET", f"{IE_URL}?fieldSelector=spec.image%3Dx", None, {}, 400, "BadRequest"),
    ("GET", f"{IE_URL}?labelSelector=a%20in", None, {}, 400, "BadRequest"),
    ("PUT", IE_URL, {}, {}, 400, "BadRequest"),
    ("DELETE", f"{IE_URL}/smollm2", {"propagationPolicy": "Sideways"}, {}, 422, "Invalid"),
    ("DELETE", f"{IE_URL}/smollm2", {"preconditions": {"uid": "nope"}}, {}, 409, "Conflict"),
]


@pytest.mark.parametrize(
    ("method", "path", "body", "headers", "code", "reason"),
    CASES,
    ids=[f"{i}-{c[0]}-{c[1].split('?')[0].rsplit('/', 1)[-1]}-{c[4]}" for i, c in enumerate(CASES)],
)
def test_refused_requests_are_status_objects(
    api: ControlPlane,
    method: str,
    path: str,
    body: Any,
    headers: dict[str, str],
    code: int,
    reason: str,
) -> None:
    api.kubectl("apply", "-f", str(EXAMPLE))  # created once, unchanged after
    before = api.obj(IE, "default", "smollm2")
    if body == "the example again":
        body = yaml.safe_load(EXAMPLE.read_text())  # what `kubectl create -f` sends
    headers = dict(headers)
    ctype = headers.pop("Content-Type", "application/json")
    status, answer = api.request(method, path, body, content_type=ctype, headers=headers)
    assert status == code, answer
    assert isinstance(answer, dict), answer
    assert (answer["apiVersion"], answer["kind"], answer["status"]) == ("v1", "Status", "Failure")
    assert (answer["code"], answer["reason"]) == (code, reason) and answer["message"]
    assert api.obj(IE, "default", "smollm2") == before  # refused: nothing changed


def test_not_found_reads_like_the_real_server(api: ControlPlane) -> None:
    _, answer = api.request("GET", f"{PODS}/nope", expect=404)
    assert answer["message"] == 'pods "nope" not found'
    assert answer["details"] == {"name": "nope", "kind": "pods"}
    failed = api.kubectl("get", "ie", "nope", check=False)
    assert failed.returncode == 1
    assert failed.stderr.strip() == (
        'Error from server (NotFound): inferenceengines.corefleet.dev "nope" not found'
    )


def test_custom_resources_are_served_as_json_only(api: ControlPlane) -> None:
    api.kubectl("apply", "-f", str(EXAMPLE))
    status, answer = api.request("GET", f"{IE_URL}/smollm2", headers={"Accept": PROTOBUF})
    assert status == 406 and "NotAcceptable" in answer  # a protobuf-encoded Status
    # what a client that prefers protobuf (kubectl, client-go) asks for: it gets JSON
    both = f"{PROTOBUF}, application/json"
    _, engine = api.request("GET", f"{IE_URL}/smollm2", headers={"Accept": both}, expect=200)
    assert engine["kind"] == "InferenceEngine"


def test_kubectl_create_dry_run_server_side_apply_and_foreground_delete(
    api: ControlPlane, tmp_path: Path
) -> None:
    made = api.kubectl("create", "configmap", "made-by-kubectl", "--from-literal=a=b")
    assert made.stdout.strip() == "configmap/made-by-kubectl created"  # a protobuf request
    api.kubectl("delete", "-f", str(EXAMPLE), "--ignore-not-found", timeout=180)

    dry = api.kubectl("apply", "--dry-run=server", "-f", str(EXAMPLE))
    assert dry.stdout.strip() == "inferenceengine.corefleet.dev/smollm2 created (server dry run)"
    assert api.obj(IE, "default", "smollm2") is None  # validated and defaulted, not stored

    applied = api.kubectl("apply", "--server-side", "-f", str(EXAMPLE))
    assert applied.stdout.strip() == "inferenceengine.corefleet.dev/smollm2 serverside-applied"
    stored = api.obj(IE, "default", "smollm2")
    assert stored is not None and stored["spec"]["engine"]["blockSize"] == 16  # defaulted
    managers = {(m["manager"], m["operation"]) for m in stored["metadata"]["managedFields"]}
    assert ("kubectl", "Apply") in managers
    manifest = yaml.safe_load(EXAMPLE.read_text())
    manifest["spec"]["engine"]["maxNumSeqs"] = 16
    changed = tmp_path / "smollm2.yaml"
    changed.write_text(yaml.safe_dump(manifest))
    api.kubectl("apply", "--server-side", "-f", str(changed))
    stored = api.obj(IE, "default", "smollm2")
    assert stored is not None and stored["spec"]["engine"]["maxNumSeqs"] == 16

    # foreground: the garbage collector removes the foregroundDeletion finalizer once it
    # watches engines (it rediscovers resources every 30 s), and kubectl waits for that
    gone = api.kubectl("delete", "ie", "smollm2", "--cascade=foreground", timeout=240)
    assert 'inferenceengine.corefleet.dev "smollm2" deleted' in gone.stdout
    assert api.obj(IE, "default", "smollm2") is None


def test_watch_resumes_and_is_told_410_once_etcd_compacted(tmp_path: Path) -> None:
    # The watch cache would serve an old resourceVersion from memory; without it for ConfigMaps
    # the watch goes to etcd, whose compaction is what expires a resourceVersion.
    flags = ["--watch-cache-sizes=configmaps#0"]
    with ControlPlane(
        tmp_path, controller_manager=False, scheduler=False, extra_apiserver_flags=flags
    ) as cluster:
        versions = []
        for i in range(5):
            _, cm = cluster.request("POST", CMS, _cm(f"cm{i}"), expect=201)
            versions.append(cm["metadata"]["resourceVersion"])
        url = f"{CMS}?watch=1&resourceVersion={versions[2]}&timeoutSeconds=1"
        _, resumed = cluster.request("GET", url, expect=200)
        names = [json.loads(line)["object"]["metadata"]["name"] for line in resumed.splitlines()]
        assert names == ["cm3", "cm4"]

        compact = {"revision": versions[3], "physical": True}
        request = urllib.request.Request(
            f"{cluster.etcd_url}/v3/kv/compaction", json.dumps(compact).encode(), method="POST"
        )
        with urllib.request.urlopen(request, timeout=30) as answer:
            assert answer.status == 200
        url = f"{CMS}?watch=1&resourceVersion={versions[1]}&timeoutSeconds=1"
        _, expired = cluster.request("GET", url, expect=200)
        assert expired["type"] == "ERROR"
        assert (expired["object"]["code"], expired["object"]["reason"]) == (410, "Expired")
        assert (
            expired["object"]["message"] == "The resourceVersion for the provided watch is too old."
        )
