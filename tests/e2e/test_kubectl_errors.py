"""Requests the emulated API server refuses get `v1 Status` answers, as from a real server.

Each refusal has the real server's HTTP code and reason, and a message that says what to do
where the emulator falls short (protobuf bodies, server-side apply, dryRun).
kubectl prints those messages as `Error from server (<reason>): <message>`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from apiserver import MERGE, REPO, ApiServer

pytestmark = pytest.mark.e2e
EXAMPLE = REPO / "examples" / "smollm2-cpu.yaml"
IE_URL = "/apis/corefleet.dev/v1alpha1/namespaces/default/inferenceengines"
PODS = "/api/v1/namespaces/default/pods"
CMS = "/api/v1/namespaces/default/configmaps"
JSON_PATCH = "application/json-patch+json"


def _cm(name: str, **meta: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, **meta}}


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
    ("POST", f"{CMS}?dryRun=All", _cm("x"), {}, 400, "BadRequest"),
    (
        "POST",
        CMS,
        b"\x0a\x02",
        {"Content-Type": "application/vnd.kubernetes.protobuf"},
        415,
        "UnsupportedMediaType",
    ),
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
    (
        "PATCH",
        f"{IE_URL}/smollm2",
        b"spec: {}",
        {"Content-Type": "application/apply-patch+yaml"},
        415,
        "UnsupportedMediaType",
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
        "GET",
        f"{IE_URL}/smollm2",
        None,
        {"Accept": "application/vnd.kubernetes.protobuf"},
        406,
        "NotAcceptable",
    ),
    ("GET", f"{IE_URL}/smollm2/logs", None, {}, 404, "NotFound"),
    ("GET", f"{PODS}?fieldSelector=nonsense", None, {}, 400, "BadRequest"),
    ("GET", f"{PODS}?watch=1&resourceVersion=abc", None, {}, 400, "BadRequest"),
    ("PUT", IE_URL, {}, {}, 405, "MethodNotAllowed"),
    ("DELETE", f"{IE_URL}/smollm2", {"propagationPolicy": "Sideways"}, {}, 422, "Invalid"),
]


@pytest.mark.parametrize(("method", "path", "body", "headers", "code", "reason"), CASES)
def test_refused_requests_are_status_objects(
    api_server: ApiServer,
    method: str,
    path: str,
    body: Any,
    headers: dict[str, str],
    code: int,
    reason: str,
) -> None:
    api_server.kubectl("apply", "-f", str(EXAMPLE))
    if body == "the example again":
        _, body = api_server.request("GET", f"{IE_URL}/smollm2", expect=200)
    ctype = headers.pop("Content-Type", "application/json")
    status, answer = api_server.request(method, path, body, content_type=ctype, headers=headers)
    assert status == code, answer
    assert isinstance(answer, dict), answer
    assert (answer["apiVersion"], answer["kind"], answer["status"]) == ("v1", "Status", "Failure")
    assert (answer["code"], answer["reason"]) == (code, reason) and answer["message"]


def test_not_found_reads_like_the_real_server(api_server: ApiServer) -> None:
    _, answer = api_server.request("GET", f"{PODS}/nope", expect=404)
    assert answer["message"] == 'pods "nope" not found'
    assert answer["details"] == {"name": "nope", "group": "", "kind": "pods"}
    failed = api_server.kubectl("get", "ie", "nope", check=False)
    assert failed.returncode == 1
    assert failed.stderr.strip() == (
        'Error from server (NotFound): inferenceengines.corefleet.dev "nope" not found'
    )


def test_kubectl_says_what_the_emulator_does_not_do(api_server: ApiServer) -> None:
    create = api_server.kubectl("create", "configmap", "x", "--from-literal=a=b", check=False)
    assert create.returncode == 1 and "protobuf" in create.stderr
    server_side = api_server.kubectl("apply", "--server-side", "-f", str(EXAMPLE), check=False)
    assert server_side.returncode == 1 and "server-side apply" in server_side.stderr
    dry_run = api_server.kubectl("apply", "--dry-run=server", "-f", str(EXAMPLE), check=False)
    assert dry_run.returncode == 1 and "dryRun is not emulated" in dry_run.stderr
    assert (
        api_server.emu.obj("corefleet.dev/v1alpha1/inferenceengines", "default", "smollm2") is None
    )
    api_server.kubectl("apply", "-f", str(EXAMPLE))
    foreground = api_server.kubectl("delete", "ie", "smollm2", "--cascade=foreground", timeout=10)
    assert 'inferenceengine.corefleet.dev "smollm2" deleted' in foreground.stdout


def test_watch_from_a_dropped_resource_version_is_told_410(tmp_path: Path) -> None:
    with ApiServer(tmp_path, history_size=3) as api:
        for i in range(5):
            api.request("POST", CMS, _cm(f"cm{i}"), expect=201)
        # resourceVersions: namespace 1, CRD 2, cm0..cm4 3..7; the history holds 5..7
        _, resumed = api.request("GET", f"{CMS}?watch=1&resourceVersion=5&timeoutSeconds=1")
        names = [json.loads(line)["object"]["metadata"]["name"] for line in resumed.splitlines()]
        assert names == ["cm3", "cm4"]
        _, expired = api.request("GET", f"{CMS}?watch=1&resourceVersion=2&timeoutSeconds=1")
        assert expired["type"] == "ERROR"
        assert (expired["object"]["code"], expired["object"]["reason"]) == (410, "Expired")
