"""The install files apply in one go on a fresh cluster: crds/ holds CRDs only (an object of a
kind whose CRD is not yet established fails `kubectl apply -f crds/`), and the peering objects
of deploy/peering/ are of kinds crds/ defines, applied after the CRDs are established."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.tools import REPO

CRDS = sorted((REPO / "crds").glob("*"))
PEERING_FILES = sorted((REPO / "deploy" / "peering").glob("*.yaml"))


def _docs(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _kinds() -> dict[tuple[str, str], str]:
    """(apiVersion, kind) -> scope, of every kind the CRDs in crds/ serve."""
    return {
        (f"{crd['spec']['group']}/{version['name']}", crd["spec"]["names"]["kind"]): crd["spec"][
            "scope"
        ]
        for path in CRDS
        for crd in _docs(path)
        for version in crd["spec"]["versions"]
        if version["served"]
    }


@pytest.mark.parametrize("path", CRDS, ids=[p.name for p in CRDS])
def test_every_document_in_crds_is_a_custom_resource_definition(path: Path) -> None:
    docs = _docs(path)
    assert docs, f"{path} is empty"
    for doc in docs:
        assert (doc["apiVersion"], doc["kind"]) == (
            "apiextensions.k8s.io/v1",
            "CustomResourceDefinition",
        ), f"{path} holds a {doc['kind']}: objects go elsewhere (deploy/), crds/ is CRDs only"


def test_the_peering_objects_are_of_kinds_crds_defines_at_their_scope() -> None:
    from corefleet.operator.cli import PEERING

    kinds = _kinds()
    found = {}
    for path in PEERING_FILES:
        for doc in _docs(path):
            scope = kinds[(doc["apiVersion"], doc["kind"])]
            assert doc["metadata"] == {"name": PEERING}, path  # -n NAMESPACE places it
            assert "spec" not in doc  # kopf writes only the status
            found[doc["kind"]] = scope
    assert found == {"ClusterKopfPeering": "Cluster", "KopfPeering": "Namespaced"}


def test_the_readme_applies_the_crds_then_waits_then_the_peering_object() -> None:
    readme = (REPO / "README.md").read_text()
    section = readme.split("## On Kubernetes", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block is not None
    commands = [line.split("#", 1)[0].strip() for line in block.group(1).splitlines()]
    apply_crds = commands.index("kubectl apply -f crds/")
    wait = commands.index("kubectl wait --for=condition=Established -f crds/")
    peering = commands.index("kubectl apply -f deploy/peering/cluster-peering.yaml")
    operator = next(i for i, c in enumerate(commands) if c.startswith("corefleet-operator"))
    assert apply_crds < wait < peering < operator
    for path in re.findall(r"-f (\S+)", block.group(1)):
        assert (REPO / path).exists(), path
