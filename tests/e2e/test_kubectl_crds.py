"""kubectl and CRD establishment on the emulator, as on a real server (issue 18).

A file holding a CRD and an object of its kind fails on a fresh server: kubectl maps every object
to a served resource before it applies any, and the kind is not served until its CRD is
established. Applying it again once the CRD is established works.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from apiserver import ApiServer, wait_until

CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.example.dev"},
    "spec": {
        "group": "example.dev",
        "scope": "Cluster",
        "names": {"kind": "Widget", "plural": "widgets"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "x-kubernetes-preserve-unknown-fields": True,
                    }
                },
            }
        ],
    },
}
WIDGET = {"apiVersion": "example.dev/v1", "kind": "Widget", "metadata": {"name": "w"}}


def test_a_crd_and_its_object_in_one_file_apply_only_once_established(tmp_path: Path) -> None:
    manifest = tmp_path / "both.yaml"
    manifest.write_text(yaml.safe_dump_all([CRD, WIDGET]))
    with ApiServer(tmp_path / "api", crds=(), crd_establish_seconds=0.5) as api:
        first = api.kubectl("apply", "-f", str(manifest), check=False)
        assert first.returncode == 1, first
        assert "ensure CRDs are installed first" in first.stderr
        assert "customresourcedefinition.apiextensions.k8s.io/widgets.example.dev created" in (
            first.stdout
        )
        api.kubectl(
            "wait", "--for=condition=Established", "crd/widgets.example.dev", "--timeout=20s"
        )
        wait_until(
            lambda: api.kubectl("api-resources", "--api-group=example.dev").stdout.count("widgets"),
            what="widgets in discovery",
        )
        second = api.kubectl("apply", "-f", str(manifest))
        assert "widget.example.dev/w created" in second.stdout
        assert api.emu.obj("example.dev/v1/widgets", "", "w") is not None


def test_an_unserved_kind_reads_as_on_a_real_server(api_server: ApiServer) -> None:
    failed = api_server.kubectl("get", "clusterkopfpeerings", check=False)
    assert failed.returncode == 1
    assert 'the server doesn\'t have a resource type "clusterkopfpeerings"' in failed.stderr
    status, answer = api_server.request("GET", "/apis/kopf.dev/v1/clusterkopfpeerings/x")
    assert (status, answer["reason"]) == (404, "NotFound")
    assert answer["message"] == "the server could not find the requested resource"
