"""Invalid InferenceEngine specs are refused by the real kube-apiserver itself.

With the CRD's own CEL `message` strings and the schema's messages (types, enums, bounds,
patterns, required fields), through `kubectl apply` and `kubectl apply --dry-run=server` alike,
and nothing is stored. The offline checker of tests/unit/operator/test_operator_crd.py
(cel-python + jsonschema) agrees with the server on every one of its valid and invalid
manifests. One control plane serves the module: every case is refused or only read.
"""

from __future__ import annotations

import copy
import json
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import yaml
from control_plane import ControlPlane
from e2e_support import CRD_FILE, REPO

sys.path.insert(0, str(REPO / "tests" / "unit" / "operator"))  # it imports crdcheck by name
from test_operator_crd import INVALID as OFFLINE_INVALID
from test_operator_crd import VALID as OFFLINE_VALID

pytestmark = pytest.mark.e2e
EXAMPLE = REPO / "examples" / "smollm2-cpu.yaml"
IE = "corefleet.dev/v1alpha1/inferenceengines"
IE_URL = "/apis/corefleet.dev/v1alpha1/namespaces/default/inferenceengines"


@pytest.fixture(scope="module")
def api(module_api_server: ControlPlane) -> ControlPlane:
    """One control plane for the module."""
    return module_api_server


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
