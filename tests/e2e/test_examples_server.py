"""Every file in examples/ on a real kube-apiserver, applied as a user applies it.

For each file: what its comments say a user does first (a namespace, a Secret, the kinds of the
tool it is for), then `kubectl apply --dry-run=server` (accepted, nothing stored), then a real
`kubectl apply`, then `kubectl get` of every object back: the server stored what the file says
(and defaulted the rest). tests/deploy/test_examples.py checks the same files offline against
schemas and the operator's parser; this is the server's verdict.

- The CRDs are installed first, as examples/README.md says (`kubectl apply -f crds/`).
- `kustomization.yaml` is applied as `kubectl apply -k examples/`, into `corefleet-demo`, the
  namespace `argocd-application.yaml` deploys the same base to; there the real HPA controller
  takes the rank count the kustomization leaves out up to the HPA's minReplicas, as
  kustomization.yaml's comment says.
- KEDA, Argo CD and the Prometheus Operator are not installed here: their kinds are served by
  stand-in CRDs of the same group, version, kind and scope that keep any field. So the server
  checks those files' kinds, names and namespaces, not the tools' own schemas.

One control plane serves the module: no two files define the same object.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from control_plane import ControlPlane
from e2e_support import REPO, wait_until

from tests.unit.operator import crdcheck

pytestmark = pytest.mark.e2e
EXAMPLES = REPO / "examples"
FILES = sorted(EXAMPLES.glob("*.yaml"))
DEMO = "corefleet-demo"  # argocd-application.yaml's destination namespace


def stand_in_crd(group: str, version: str, kind: str, scope: str = "Namespaced") -> dict[str, Any]:
    """A CRD serving `kind` that keeps whatever it is given (the tool's own CRD is not here)."""
    plural = kind.lower() + "s"
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{group}"},
        "spec": {
            "group": group,
            "scope": scope,
            "names": {"kind": kind, "plural": plural, "singular": kind.lower()},
            "versions": [
                {
                    "name": version,
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


TOOLS = {  # the kinds of the tools the examples are for, as each one's installation adds them
    "servicemonitor.yaml": stand_in_crd("monitoring.coreos.com", "v1", "ServiceMonitor"),
    "keda-scaledobject.yaml": stand_in_crd("keda.sh", "v1alpha1", "ScaledObject"),
    "argocd-application.yaml": stand_in_crd("argoproj.io", "v1alpha1", "Application"),
}
NAMESPACES = {  # where the tools live, as the files' comments say; and the GitOps destination
    "prometheus-adapter-rules.yaml": "monitoring",
    "argocd-application.yaml": "argocd",
    "kustomization.yaml": DEMO,
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """A control plane with crds/ installed and Established, as examples/README.md says."""
    with ControlPlane(tmp_path_factory.mktemp("examples")) as api:
        api.kubectl("apply", "-f", str(REPO / "crds"), timeout=60)
        api.wait_crds_established(REPO / "crds")
        yield api


def source(path: Path) -> list[str]:
    """kubectl's arguments for the objects of one example file."""
    if path.name == "kustomization.yaml":
        return ["-k", str(EXAMPLES), "-n", DEMO]
    return ["-f", str(path)]


def documents(api: ControlPlane, path: Path) -> list[dict[str, Any]]:
    """The objects a file stands for (a kustomization's: its rendering)."""
    if path.name == "kustomization.yaml":
        text = api.kubectl("kustomize", str(EXAMPLES)).stdout
    else:
        text = path.read_text()
    return [doc for doc in yaml.safe_load_all(text) if doc is not None]


def prepare(api: ControlPlane, path: Path, tmp_path: Path) -> None:
    """What the file's comments say must exist before it is applied."""
    if path.name in TOOLS:
        crd = TOOLS[path.name]
        manifest = tmp_path / "tool-crd.yaml"
        manifest.write_text(yaml.safe_dump(crd))
        api.kubectl("apply", "-f", str(manifest))
        api.wait_crds_established(manifest)
    if path.name in NAMESPACES:
        namespace = {"apiVersion": "v1", "kind": "Namespace"}
        namespace["metadata"] = {"name": NAMESPACES[path.name]}
        api.kubectl("apply", "-f", "-", input=yaml.safe_dump(namespace))
    for command in secret_commands(path):
        name = command.split()[4]  # kubectl create secret generic NAME ...
        if api.obj("v1/secrets", "default", name) is None:
            # the very command of the file's comment, through a shell as a user pastes it
            subprocess.run(
                ["bash", "-c", command], env=api.env(), check=True, capture_output=True, timeout=60
            )


def secret_commands(path: Path) -> list[str]:
    """The `kubectl create secret` commands a file's comments tell the user to run."""
    found = re.findall(r"^#\s+(kubectl create secret .*)$", path.read_text(), re.M)
    return [str(command) for command in found]


def contains(stored: Any, wanted: Any, where: str = "") -> list[str]:
    """Where `stored` differs from `wanted`, a field of `wanted` at a time (the server adds
    defaults and metadata; it must not change or drop what the file says)."""
    if isinstance(wanted, Mapping):
        if not isinstance(stored, Mapping):
            return [f"{where}: {stored!r} is not an object"]
        return [
            difference
            for key, value in wanted.items()
            for difference in contains(stored.get(key), value, f"{where}.{key}")
        ]
    if isinstance(wanted, list):
        if not isinstance(stored, list) or len(stored) != len(wanted):
            return [f"{where}: {stored!r} != {wanted!r}"]
        return [
            difference
            for i, (s, w) in enumerate(zip(stored, wanted, strict=True))
            for difference in contains(s, w, f"{where}[{i}]")
        ]
    return [] if stored == wanted else [f"{where}: {stored!r} != {wanted!r}"]


def resource(doc: Mapping[str, Any]) -> str:
    """kubectl's name for one object: kind.group/name."""
    group = doc["apiVersion"].rpartition("/")[0]
    return f"{doc['kind'].lower()}{'.' + group if group else ''}/{doc['metadata']['name']}"


def test_every_example_is_covered() -> None:
    assert {p.name for p in FILES} >= {"smollm2-cpu.yaml", "llama-gpu.yaml", "kustomization.yaml"}
    assert set(TOOLS) | set(NAMESPACES) <= {p.name for p in FILES}
    assert secret_commands(EXAMPLES / "llama-gpu.yaml"), "llama-gpu.yaml explains its Secret"


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_example_applies_on_a_real_server(
    cluster: ControlPlane, path: Path, tmp_path: Path
) -> None:
    prepare(cluster, path, tmp_path)
    docs = documents(cluster, path)
    assert docs, f"{path.name} has no object"
    names = [resource(doc) for doc in docs]

    dry = cluster.kubectl("apply", "--dry-run=server", *source(path))
    assert sorted(dry.stdout.splitlines()) == sorted(f"{n} created (server dry run)" for n in names)
    absent = cluster.kubectl("get", *source(path), check=False)
    assert absent.returncode == 1 and absent.stderr.count("(NotFound)") == len(docs), absent

    applied = cluster.kubectl("apply", *source(path))
    assert sorted(applied.stdout.splitlines()) == sorted(f"{n} created" for n in names)
    got = yaml.safe_load(cluster.kubectl("get", *source(path), "-o", "yaml").stdout)
    stored = got["items"] if got.get("kind") == "List" else [got]
    by_name = {resource(obj): obj for obj in stored}
    assert sorted(by_name) == sorted(names)
    for doc in docs:
        assert contains(by_name[resource(doc)], doc) == [], resource(doc)

    # What the file leaves unsaid, the server defaults as the offline checker does (the one
    # tests/deploy/test_examples.py and the operator's unit tests rely on).
    for doc in docs:
        if doc["kind"] == "InferenceEngine":
            assert contains(by_name[resource(doc)], crdcheck.defaulted(doc)) == [], resource(doc)


def test_the_api_key_secret_the_gpu_example_names_is_the_one_its_comment_creates(
    cluster: ControlPlane, tmp_path: Path
) -> None:
    path = EXAMPLES / "llama-gpu.yaml"
    prepare(cluster, path, tmp_path)
    [engine] = [d for d in documents(cluster, path) if d["kind"] == "InferenceEngine"]
    ref = engine["spec"]["coordinator"]["apiKeySecretRef"]
    secret = cluster.obj("v1/secrets", "default", ref["name"])
    assert secret is not None, f"the comment does not create Secret {ref['name']}"
    assert ref.get("key", "api-key") in secret["data"]


def test_the_kustomization_leaves_the_rank_count_to_the_hpa(
    cluster: ControlPlane, tmp_path: Path
) -> None:
    # kustomization.yaml: without dataParallelSize in git the server defaults it to 1 on
    # create, and the HPA raises it to minReplicas, through the CRD's scale subresource.
    path = EXAMPLES / "kustomization.yaml"
    prepare(cluster, path, tmp_path)
    cluster.kubectl("apply", *source(path))
    docs = documents(cluster, path)
    [hpa] = [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"]
    [engine] = [d for d in docs if d["kind"] == "InferenceEngine"]
    assert "dataParallelSize" not in engine["spec"]

    def ranks() -> Any:
        stored = cluster.obj("corefleet.dev/v1alpha1/inferenceengines", DEMO, "smollm2")
        return stored and stored["spec"]["dataParallelSize"]

    wait_until(
        lambda: ranks() == hpa["spec"]["minReplicas"],
        180,
        interval=0.5,
        what=f"the HPA scaling smollm2 in {DEMO} to minReplicas",
    )
    stored = cluster.obj("autoscaling/v2/horizontalpodautoscalers", DEMO, "smollm2")
    assert stored is not None
    able = [c for c in stored["status"]["conditions"] if c["type"] == "AbleToScale"]
    assert able and able[0]["status"] == "True", stored["status"]
