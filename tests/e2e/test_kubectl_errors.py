"""What a real kube-apiserver refuses, and how: `v1 Status` answers, and what kubectl prints.

- Malformed or conflicting requests get a Status with the HTTP code and reason a client acts on.
- Invalid InferenceEngine specs are refused by the server itself, with the CRD's own CEL
  `message` strings and the schema's messages (types, enums, bounds, patterns, required fields),
  through `kubectl apply` and `kubectl apply --dry-run=server` alike, and nothing is stored.
- The offline checker of tests/unit/operator/test_operator_crd.py (cel-python + jsonschema)
  agrees with the server on every one of its valid and invalid manifests.

One control plane serves the whole module (the cases only read, or are refused); the watch-expiry
test starts its own, with the watch cache of ConfigMaps off so that etcd's compaction shows.
"""

from __future__ import annotations

import copy
import json
import sys
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from admin_client import MERGE
from apiserver import CRD_FILE, REPO
from control_plane import ControlPlane

sys.path.insert(0, str(REPO / "tests" / "unit" / "operator"))  # it imports crdcheck by name
from test_operator_crd import INVALID as OFFLINE_INVALID
from test_operator_crd import VALID as OFFLINE_VALID

pytestmark = pytest.mark.e2e
EXAMPLE = REPO / "examples" / "smollm2-cpu.yaml"
IE = "corefleet.dev/v1alpha1/inferenceengines"
IE_URL = "/apis/corefleet.dev/v1alpha1/namespaces/default/inferenceengines"
PODS = "/api/v1/namespaces/default/pods"
CMS = "/api/v1/namespaces/default/configmaps"
JSON_PATCH = "application/json-patch+json"
PROTOBUF = "application/vnd.kubernetes.protobuf"


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """One control plane for the module, with the InferenceEngine CRD established."""
    with ControlPlane(tmp_path_factory.mktemp("errors")) as cluster:
        cluster.kubectl("apply", "-f", str(CRD_FILE), timeout=60)
        cluster.wait_crds_established(CRD_FILE)
        yield cluster


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


# -- invalid InferenceEngine specs -----------------------------------------------------------

CRD = yaml.safe_load(CRD_FILE.read_text())
BASE: dict[str, Any] = {
    "apiVersion": "corefleet.dev/v1alpha1",
    "kind": "InferenceEngine",
    "metadata": {"name": "bad"},
    "spec": {"image": "ghcr.io/corefleet/corefleet:0.1.0", "model": {"path": "/models/m"}},
}
PVC = {"persistentVolumeClaim": {"claimName": "weights"}}


def _cel_messages(schema: Mapping[str, Any]) -> Iterator[str]:
    for rule in schema.get("x-kubernetes-validations") or ():
        yield rule["message"]
    for sub in (schema.get("properties") or {}).values():
        yield from _cel_messages(sub)
    if isinstance(schema.get("items"), Mapping):
        yield from _cel_messages(schema["items"])


CEL_MESSAGES = set(_cel_messages(CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]))


def engine(name: str = "bad", **spec: Any) -> dict[str, Any]:
    """BASE named `name`, with top-level spec fields replaced (None deletes)."""
    out = copy.deepcopy(BASE)
    out["metadata"]["name"] = name
    for key, value in spec.items():
        if value is None:
            out["spec"].pop(key, None)
        else:
            out["spec"][key] = value
    return out


# name -> (manifest, the field the server names, the CRD rule's message)
CEL_CASES: dict[str, tuple[dict[str, Any], str, str]] = {
    "name too long for rank hostnames": (
        engine("x" * 51),
        "<nil>",
        "the name must be at most 50 characters (rank pods are <name>-engine-<rank>, and "
        "hostnames allow 63)",
    ),
    "tensor x pipeline beyond a node": (
        engine(tensorParallelSize=4, pipelineParallelSize=4),
        "spec.pipelineParallelSize",
        "tensorParallelSize x pipelineParallelSize must be at most 8 (the devices of one node)",
    ),
    "expert parallel with tensor parallelism": (
        engine(enableExpertParallel=True, tensorParallelSize=2),
        "spec.enableExpertParallel",
        "enableExpertParallel needs tensorParallelSize x pipelineParallelSize == 1 (each rank "
        "of the group runs the model in one process)",
    ),
    "batch below model length": (
        engine(
            model={"path": "/m", "maxModelLen": 8192},
            engine={"enableChunkedPrefill": False, "maxNumBatchedTokens": 4096},
        ),
        "spec.engine.maxNumBatchedTokens",
        "engine.maxNumBatchedTokens must be >= model.maxModelLen unless "
        "engine.enableChunkedPrefill is true",
    ),
    "batch below max seqs": (
        engine(engine={"maxNumSeqs": 256, "maxNumBatchedTokens": 128}),
        "spec.engine.maxNumBatchedTokens",
        "engine.maxNumBatchedTokens must be >= engine.maxNumSeqs",
    ),
    "two volume sources": (
        engine(model={"path": "/models/m", "volume": {**PVC, "hostPath": {"path": "/data"}}}),
        "spec.model.volume",
        "model.volume needs exactly one volume source",
    ),
    "path outside the mount": (
        engine(model={"path": "/opt/m", "volume": PVC}),
        "spec.model.path",
        "with a volume, model.path must lie under model.mountPath",
    ),
    "drain timeout with Abort": (
        engine(shutdown={"mode": "Abort", "drainTimeoutSeconds": 5}),
        "spec.shutdown.drainTimeoutSeconds",
        "shutdown.drainTimeoutSeconds is only allowed with mode Drain",
    ),
    "autoscaling minimum above its maximum": (
        engine(coordinator={"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}),
        "spec.coordinator.autoscaling.minReplicas",
        "coordinator.autoscaling.minReplicas must be <= maxReplicas",
    ),
    "node port on ClusterIP": (
        engine(coordinator={"service": {"nodePort": 30080}}),
        "spec.coordinator.service.nodePort",
        "coordinator.service.nodePort is only allowed with type NodePort",
    ),
    "reserved env name": (
        engine(env=[{"name": "POD_IP", "value": "1.2.3.4"}]),
        "spec.env",
        "POD_IP, POD_NAME, POD_NAMESPACE and COREFLEET_CURVE_* are set by the operator",
    ),
    "value and valueFrom": (
        engine(env=[{"name": "X", "value": "1", "valueFrom": {"fieldRef": {}}}]),
        "spec.env[0]",
        "value and valueFrom are mutually exclusive",
    ),
}

# name -> (manifest, a line of the server's refusal)
SCHEMA_CASES: dict[str, tuple[dict[str, Any], str]] = {
    "relative model path (pattern)": (
        engine(model={"path": "models/x"}),
        "spec.model.path: Invalid value: \"models/x\": spec.model.path in body should match '^/'",
    ),
    "negative ranks (minimum)": (
        engine(dataParallelSize=-1),
        "spec.dataParallelSize: Invalid value: -1: spec.dataParallelSize in body should be "
        "greater than or equal to 0",
    ),
    "ranks beyond the maximum": (
        engine(dataParallelSize=1025),
        "spec.dataParallelSize: Invalid value: 1025: spec.dataParallelSize in body should be "
        "less than or equal to 1024",
    ),
    "zero memory share (exclusive minimum)": (
        engine(engine={"gpuMemoryUtilization": 0}),
        "spec.engine.gpuMemoryUtilization: Invalid value: 0: spec.engine.gpuMemoryUtilization "
        "in body should be greater than 0",
    ),
    "unknown dtype (enum)": (
        engine(model={"path": "/m", "dtype": "int8"}),
        'spec.model.dtype: Unsupported value: "int8": supported values: "auto", "float32", '
        '"float16", "bfloat16"',
    ),
    "odd block size (integer enum)": (
        engine(engine={"blockSize": 12}),
        'spec.engine.blockSize: Unsupported value: 12: supported values: "8", "16", "32", '
        '"64", "128"',
    ),
    "unknown routing (enum)": (
        engine(coordinator={"routing": "Random"}),
        'spec.coordinator.routing: Unsupported value: "Random": supported values: '
        '"LeastLoaded", "PrefixAware", "PrefixHash", "RoundRobin"',
    ),
    "expert parallel as a string (type)": (
        engine(enableExpertParallel="true"),
        'spec.enableExpertParallel: Invalid value: "string": spec.enableExpertParallel in body '
        'must be of type boolean: "string"',
    ),
    "no image (required)": (engine(image=None), "spec.image: Required value"),
    "empty image (min length)": (
        engine(image=""),
        'spec.image: Invalid value: "": spec.image in body should be at least 1 chars long',
    ),
    "autoscaling without a maximum (required)": (
        engine(coordinator={"autoscaling": {"minReplicas": 2}}),
        "spec.coordinator.autoscaling.maxReplicas: Required value",
    ),
}


def refusal(stderr: str, name: str) -> list[str]:
    """The lines of kubectl's message for a 422 on InferenceEngine `name`: one error per line."""
    head = f'The InferenceEngine "{name}" is invalid: '
    assert stderr.startswith(head), stderr
    rest = stderr[len(head) :]
    return [line.strip().removeprefix("* ") for line in rest.splitlines() if line.strip()]


def _refused_both_ways(api: ControlPlane, manifest: dict[str, Any], line: str) -> None:
    """`kubectl apply --dry-run=server` and `kubectl apply` are refused with `line`, and the
    engine is not stored."""
    name = manifest["metadata"]["name"]
    for dry_run in (["--dry-run=server"], []):
        done = api.kubectl(
            "apply", *dry_run, "-f", "-", input=yaml.safe_dump(manifest), check=False
        )
        assert done.returncode == 1, (dry_run, done)
        assert line in refusal(done.stderr, name), (dry_run, done.stderr)
        assert api.obj(IE, "default", name) is None


def test_there_are_cases_for_every_cel_rule_and_schema_constraint() -> None:
    assert {message for _, _, message in CEL_CASES.values()} == CEL_MESSAGES
    assert len(SCHEMA_CASES) >= 8


@pytest.mark.parametrize("name", sorted(CEL_CASES))
def test_cel_rules_refuse_with_the_crds_message(api: ControlPlane, name: str) -> None:
    manifest, field, message = CEL_CASES[name]
    assert message in CEL_MESSAGES  # the server repeats the CRD's own words
    _refused_both_ways(api, manifest, f"{field}: Invalid value: {message}")


@pytest.mark.parametrize("name", sorted(SCHEMA_CASES))
def test_the_schema_refuses_with_the_servers_message(api: ControlPlane, name: str) -> None:
    manifest, line = SCHEMA_CASES[name]
    _refused_both_ways(api, manifest, line)


def test_an_unknown_field_is_refused_by_strict_field_validation(api: ControlPlane) -> None:
    manifest = engine("typo", replicas=3)  # dataParallelSize is the rank count
    for dry_run in (["--dry-run=server"], []):
        done = api.kubectl(
            "apply", *dry_run, "-f", "-", input=yaml.safe_dump(manifest), check=False
        )
        assert done.returncode == 1, done
        assert 'strict decoding error: unknown field "spec.replicas"' in done.stderr
        assert done.stderr.startswith("Error from server (BadRequest)"), done.stderr
    assert api.obj(IE, "default", "typo") is None


def test_an_update_that_breaks_a_rule_is_refused_and_changes_nothing(api: ControlPlane) -> None:
    api.kubectl("apply", "-f", str(EXAMPLE))
    before = api.obj(IE, "default", "smollm2")
    assert before is not None and before["spec"]["shutdown"]["drainTimeoutSeconds"] == 60
    abort = json.dumps({"spec": {"shutdown": {"mode": "Abort"}}})  # drainTimeoutSeconds stays
    done = api.kubectl("patch", "ie", "smollm2", "--type", "merge", "-p", abort, check=False)
    assert done.returncode == 1
    assert refusal(done.stderr, "smollm2") == [
        "spec.shutdown.drainTimeoutSeconds: Invalid value: shutdown.drainTimeoutSeconds is only "
        "allowed with mode Drain"
    ]
    assert api.obj(IE, "default", "smollm2") == before


@pytest.mark.parametrize("name", sorted(OFFLINE_INVALID))
def test_the_server_refuses_what_the_offline_checker_refuses(api: ControlPlane, name: str) -> None:
    body, _fragment = OFFLINE_INVALID[name]
    status, answer = api.request("POST", f"{IE_URL}?dryRun=All", body)
    assert (status, answer["reason"]) == (422, "Invalid"), answer


@pytest.mark.parametrize("name", sorted(OFFLINE_VALID))
def test_the_server_accepts_what_the_offline_checker_accepts(api: ControlPlane, name: str) -> None:
    status, answer = api.request("POST", f"{IE_URL}?dryRun=All", OFFLINE_VALID[name])
    assert status == 201, answer
