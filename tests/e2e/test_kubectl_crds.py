"""Our CRDs on a real kube-apiserver, installed the way a user installs them (issue 18, issue 35).

A file holding a CRD and an object of its kind fails on a fresh server: kubectl maps every object
to a served resource before it applies any, and the kind is not served until its CRD is
established. Applying it again once the CRD is established works. The kopf peering CRDs
(crds/kopf-peering.yaml) and the peering objects of deploy/peering/ install as documented,
and keep the status kopf writes to them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from admin_client import MERGE
from control_plane import ControlPlane
from e2e_support import CRD_FILE, REPO, wait_until

pytestmark = pytest.mark.e2e
EXAMPLE = REPO / "examples" / "smollm2-cpu.yaml"
PEERINGS = REPO / "deploy" / "peering"


def test_the_crd_and_an_engine_in_one_file_apply_only_once_established(tmp_path: Path) -> None:
    manifest = tmp_path / "both.yaml"
    manifest.write_text(CRD_FILE.read_text() + "\n---\n" + EXAMPLE.read_text())
    with ControlPlane(tmp_path / "api", controller_manager=False, scheduler=False) as api:
        first = api.kubectl("apply", "-f", str(manifest), check=False)
        assert first.returncode == 1, first
        assert "ensure CRDs are installed first" in first.stderr
        assert (
            "customresourcedefinition.apiextensions.k8s.io/inferenceengines.corefleet.dev created"
        ) in first.stdout
        assert api.obj("corefleet.dev/v1alpha1/inferenceengines", "default", "smollm2") is None
        api.wait_crds_established(CRD_FILE)
        wait_until(
            lambda: (
                "inferenceengines"
                in api.kubectl("api-resources", "--api-group=corefleet.dev").stdout
            ),
            60,
            interval=0.5,
            what="inferenceengines in discovery",
        )
        second = api.kubectl("apply", "-f", str(manifest))
        assert "inferenceengine.corefleet.dev/smollm2 created" in second.stdout
        assert (
            "customresourcedefinition.apiextensions.k8s.io/inferenceengines.corefleet.dev unchanged"
        ) in second.stdout
        stored = api.obj("corefleet.dev/v1alpha1/inferenceengines", "default", "smollm2")
        assert stored is not None and stored["spec"]["dataParallelSize"] == 2


def test_the_kopf_peering_crds_and_objects_install_as_documented(
    api_server: ControlPlane,
) -> None:
    # Before: the kinds are not served, and kubectl and the API say so.
    failed = api_server.kubectl("get", "clusterkopfpeerings", check=False)
    assert failed.returncode == 1
    assert 'the server doesn\'t have a resource type "clusterkopfpeerings"' in failed.stderr
    status, answer = api_server.request("GET", "/apis/kopf.dev/v1/clusterkopfpeerings/x")
    assert (status, answer) == (404, "404 page not found\n")  # no such group: not even a Status

    # deploy/peering/cluster-peering.yaml's own commands, then the namespaced one; its
    # `kubectl wait --for=condition=Established -f crds/` polled here instead (see
    # AdminClient.wait_crds_established)
    api_server.kubectl("apply", "-f", str(REPO / "crds"))
    api_server.wait_crds_established(REPO / "crds")
    assert "No resources found" in api_server.kubectl("get", "clusterkopfpeerings").stderr
    status, answer = api_server.request("GET", "/apis/kopf.dev/v1/clusterkopfpeerings/x")
    assert (status, answer["reason"]) == (404, "NotFound")
    assert answer["message"] == 'clusterkopfpeerings.kopf.dev "x" not found'
    out = api_server.kubectl("apply", "-f", str(PEERINGS / "cluster-peering.yaml")).stdout
    assert out.strip() == "clusterkopfpeering.kopf.dev/corefleet-operator created"
    out = api_server.kubectl(
        "apply", "-n", "default", "-f", str(PEERINGS / "namespaced-peering.yaml")
    ).stdout
    assert out.strip() == "kopfpeering.kopf.dev/corefleet-operator created"

    # kopf lists each live replica in the object's status (a plain merge patch: no status
    # subresource), and the schema keeps what it writes.
    replica = {"priority": 0, "lifetime": 60, "lastseen": "2026-01-01T00:00:00.000000"}
    for url in (
        "/apis/kopf.dev/v1/clusterkopfpeerings/corefleet-operator",
        "/apis/kopf.dev/v1/namespaces/default/kopfpeerings/corefleet-operator",
    ):
        body = {"status": {"operator-1": replica}}
        api_server.request("PATCH", url, body, content_type=MERGE, expect=200)
        stored = api_server.get(url)
        assert stored is not None and stored["status"] == {"operator-1": replica}, stored
