"""kubectl ergonomics of the InferenceEngine with the real kubectl: `get -o wide` and `explain`.

The real kube-apiserver answers `kubectl get` with a Table of every printer column, each with its
priority; kubectl prints the priority-0 ones, and the priority-1 ones too with `-o wide`.
`kubectl explain` reads the CRD's schema from the server's OpenAPI v3 documents, which the
apiextensions server publishes from the CRD, so what it prints are the CRD's descriptions. The
server publishes them a moment after the CRD is Established: until then `kubectl explain ie` says
the server has no such resource type, so the tests wait for the document first. `kubectl describe
ie` with the operator's Events is in tests/integration/operator/test_operator_describe.py.

One control plane serves the module: only the `-o wide` test writes (the example engine).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
import yaml
from control_plane import ControlPlane
from e2e_support import CRD_FILE, REPO, parse_table, wait_until

pytestmark = pytest.mark.e2e
EXAMPLE = REPO / "examples" / "smollm2-cpu.yaml"
IE = "corefleet.dev/v1alpha1/inferenceengines"
SCHEMA = yaml.safe_load(CRD_FILE.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
DEFAULT_COLUMNS = ["NAME", "RANKS", "READY", "ENDPOINT", "AGE"]
WIDE_COLUMNS = [
    "DP",
    "TP",
    "PP",
    "EP",
    "UP-TO-DATE",
    "ROUTING",
    "COORDINATOR",
    "COORDINATORS",
    "SHUTDOWN",
    "MODEL",
]


GROUP_VERSION = "apis/corefleet.dev/v1alpha1"


@pytest.fixture(scope="module")
def api_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """A control plane with the CRD Established, served in discovery, and its OpenAPI v3
    document published."""
    with ControlPlane(tmp_path_factory.mktemp("explain")) as api:
        api.kubectl("apply", "-f", str(CRD_FILE), timeout=60)
        api.wait_crds_established(CRD_FILE)
        wait_until(
            lambda: GROUP_VERSION in (api.get("/openapi/v3") or {}).get("paths", {}),
            120,
            interval=0.5,
            what="the CRD's OpenAPI v3 document",
        )
        wait_until(
            lambda: (
                "inferenceengines"
                in api.kubectl("api-resources", "--api-group=corefleet.dev").stdout
            ),
            120,
            interval=0.5,
            what="inferenceengines in discovery",
        )
        yield api


def words(text: str) -> str:
    """Text with its whitespace runs made single spaces (kubectl explain wraps lines)."""
    return " ".join(text.split())


def test_get_wide_shows_the_parallel_layout_and_routing(api_server: ControlPlane) -> None:
    api_server.kubectl("apply", "-f", str(EXAMPLE))
    example = yaml.safe_load(EXAMPLE.read_text())["spec"]
    [row] = parse_table(api_server.kubectl("get", "ie").stdout)
    assert list(row) == DEFAULT_COLUMNS  # tests/e2e/test_smollm2_fleet.py reads RANKS and READY

    api_server.patch_status(
        IE,
        "default",
        "smollm2",
        {"updatedReplicas": 2, "coordinatorReady": True, "coordinatorSummary": "1/1"},
    )
    [wide] = parse_table(api_server.kubectl("get", "ie", "-o", "wide").stdout)
    assert list(wide) == DEFAULT_COLUMNS + WIDE_COLUMNS
    assert wide["DP"] == str(example["dataParallelSize"])
    assert wide["TP"] == wide["PP"] == "1"  # the schema's defaults
    assert wide["EP"] == "false"
    assert wide["UP-TO-DATE"] == "2" and wide["COORDINATOR"] == "true"
    assert wide["COORDINATORS"] == "1/1"
    assert wide["ROUTING"] == (example.get("coordinator") or {}).get("routing", "LeastLoaded")
    assert wide["SHUTDOWN"] == (example.get("shutdown") or {}).get("mode", "Drain")
    assert wide["MODEL"] == example["model"]["path"]

    api_server.kubectl("scale", "ie/smollm2", "--replicas=3")
    [wide] = parse_table(api_server.kubectl("get", "ie", "smollm2", "-o", "wide").stdout)
    assert wide["DP"] == "3"


def test_explain_spec_prints_every_fields_description(api_server: ControlPlane) -> None:
    out = api_server.kubectl("explain", "ie.spec").stdout
    assert re.search(r"KIND:\s+InferenceEngine", out) and re.search(r"VERSION:\s+v1alpha1", out)
    spec = SCHEMA["properties"]["spec"]
    text = words(out)
    assert words(spec["description"]) in text
    for name, field in spec["properties"].items():
        assert re.search(rf"^  {name}\t<", out, re.M), f"{name} is not listed"
        assert words(field["description"]) in text, f"{name}'s description is not shown"


def test_explain_reaches_nested_fields_and_recurses(api_server: ControlPlane) -> None:
    field = SCHEMA["properties"]["spec"]["properties"]["engine"]["properties"]["maxNumSeqs"]
    out = api_server.kubectl("explain", "ie.spec.engine.maxNumSeqs").stdout
    assert re.search(r"FIELD:\s+maxNumSeqs <integer>", out)
    assert words(field["description"]) in words(out)

    status = api_server.kubectl("explain", "inferenceengine.status.ranks.stage").stdout
    assert "Draining" in status

    listed = api_server.kubectl("explain", "ie.spec", "--recursive").stdout
    for name in ("gpuMemoryUtilization", "claimName", "apiKeySecretRef", "drainTimeoutSeconds"):
        assert re.search(rf"^\s+{name}\s+<", listed, re.M), name


def test_the_openapi_index_names_the_crd_group_version(api_server: ControlPlane) -> None:
    _, index = api_server.request("GET", "/openapi/v3", expect=200)
    url = index["paths"][GROUP_VERSION]["serverRelativeURL"]
    assert url.startswith("/openapi/v3/apis/corefleet.dev/v1alpha1?hash=")
    _, doc = api_server.request("GET", url, expect=200)
    schema = doc["components"]["schemas"]["dev.corefleet.v1alpha1.InferenceEngine"]
    assert schema["x-kubernetes-group-version-kind"] == [
        {"group": "corefleet.dev", "version": "v1alpha1", "kind": "InferenceEngine"}
    ]
    assert schema["properties"]["spec"] == SCHEMA["properties"]["spec"]
    api_server.request("GET", "/openapi/v3/apis/nothing.example/v1", expect=404)
