"""Every manifest in examples/ is one a cluster would accept, and the files agree with each other.

- Built-in kinds: the Kubernetes JSON schemas of `K8S_VERSION`, strict (unknown fields fail).
- InferenceEngine: the CRD's schema and CEL rules (`crdcheck`), no field the CRD lacks, the
  operator's own parser, and the children the operator would build from it (strict schemas too,
  since the CRD passes resources, tolerations and volumes through verbatim).
- KEDA, Argo CD and Prometheus Operator kinds, whose schemas are not at hand: their essentials
  by hand. Autoscalers must target an engine defined here, at a version the CRD serves.
- kustomization.yaml: its resources exist, and its rendering validates like the files.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from corefleet.engine.models.default_model import DEFAULT_GGUF_NAME
from corefleet.operator import resources
from corefleet.operator.naming import Owner, coordinator_name, curve_secret_name
from corefleet.operator.spec import GROUP, KIND
from tests.deploy.examples_support import (
    APPLICATION,
    DOCS,
    ENGINE,
    ENGINES,
    EXAMPLES,
    FILES,
    KUSTOMIZATION,
    MAX_RANKS,
    SCALED_OBJECT,
    SERVICE_MONITOR,
    WAITING,
    adapter_name,
    adapter_rules,
    assert_slow_scale_down,
    builtin_params,
    engine_errors,
    k8s_errors,
    kind_key,
    load_docs,
    name_of,
    params_of,
    parsed,
    target_engine,
)
from tests.deploy.tools import REPO, run

# -- every file, every document --------------------------------------------------------------


def test_examples_exist() -> None:
    names = {p.name for p in FILES}
    assert {"smollm2-cpu.yaml", "llama-gpu.yaml", "hpa.yaml", "kustomization.yaml"} <= names


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_every_file_parses(path: Path) -> None:
    docs = load_docs(path)
    assert docs, f"{path.name} has no document"
    for doc in docs:
        assert isinstance(doc, dict), f"{path.name}: a document is not a mapping"


@pytest.mark.parametrize("doc", params_of())
def test_every_document_has_a_kind_and_a_name(doc: Mapping[str, Any]) -> None:
    api_version, kind = kind_key(doc)
    assert api_version and kind
    if (api_version, kind) != KUSTOMIZATION:
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name_of(doc)), doc.get("metadata")


@pytest.mark.parametrize("doc", builtin_params())
def test_builtin_kind_is_valid_kubernetes(doc: Mapping[str, Any]) -> None:
    assert k8s_errors(doc) == []


def test_readme_lists_every_file() -> None:
    readme = (EXAMPLES / "README.md").read_text()
    missing = [p.name for p in FILES if f"`{p.name}`" not in readme]
    assert missing == [], f"examples/README.md does not mention {missing}"


# -- InferenceEngine -------------------------------------------------------------------------


def test_engine_names_are_unique() -> None:
    names = [name_of(doc) for _, _, doc in DOCS if kind_key(doc)[1] == KIND]
    assert sorted(names) == sorted(ENGINES)
    assert {"smollm2", "llama"} <= set(ENGINES)


@pytest.mark.parametrize("doc", params_of(ENGINE))
def test_engine_passes_the_crd(doc: Mapping[str, Any]) -> None:
    assert engine_errors(doc) == []


@pytest.mark.parametrize("doc", params_of(ENGINE))
def test_engine_parses_and_its_children_are_valid_kubernetes(doc: Mapping[str, Any]) -> None:
    spec = parsed(doc)
    owner = Owner(name=name_of(doc), namespace="default", uid="0b1c2d3e-uid")
    children = [*resources.build_children(owner, spec), resources.build_engine_pod(owner, spec, 0)]
    for child in children:
        assert k8s_errors(child) == [], f"{child['kind']} {child['metadata']['name']}"


@pytest.mark.parametrize("doc", params_of(ENGINE))
def test_engine_model_comes_from_the_image_or_a_claim_in_the_same_file(
    doc: Mapping[str, Any],
) -> None:
    model = parsed(doc).model
    if model.volume is None:
        # Nothing mounted: the path is inside the image, whose only model is the embedded one.
        assert model.path.endswith("/" + DEFAULT_GGUF_NAME), model.path
        return
    claim = (model.volume.get("persistentVolumeClaim") or {}).get("claimName")
    if claim is not None:
        (file,) = [f for f, _, d in DOCS if d is doc]
        claims = {
            name_of(d) for f, _, d in DOCS if f == file and d["kind"] == "PersistentVolumeClaim"
        }
        assert claim in claims, f"{file} mounts claim {claim!r} but does not define it"


def _secrets_read(children: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    """(Secret, key, env variable) of every secretKeyRef in the children's containers, and
    (Secret, "", "volume") of every secret volume."""
    found: set[tuple[str, str, str]] = set()

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            ref = (value.get("valueFrom") or {}).get("secretKeyRef")
            if ref is not None:
                found.add((ref["name"], ref["key"], value["name"]))
            if isinstance(value.get("secret"), dict) and "secretName" in value["secret"]:
                found.add((value["secret"]["secretName"], "", "volume"))
            for sub in value.values():
                walk(sub)
        elif isinstance(value, list):
            for sub in value:
                walk(sub)

    walk(children)
    return found


def _user_secrets(doc: Mapping[str, Any]) -> set[tuple[str, str, str]]:
    """The Secrets the engine's pods read that the operator does not create itself (it makes
    NAME-curve): the ones a user must provide."""
    owner = Owner(name=name_of(doc), namespace="default", uid="0b1c2d3e-uid")
    spec = parsed(doc)
    children = [*resources.build_children(owner, spec), resources.build_engine_pod(owner, spec, 0)]
    return {s for s in _secrets_read(children) if s[0] != curve_secret_name(owner.name)}


def _api_key_ref(doc: Mapping[str, Any]) -> Any:
    return ((doc.get("spec") or {}).get("coordinator") or {}).get("apiKeySecretRef")


WITH_API_KEY = [p for p in params_of(ENGINE) if _api_key_ref(p.values[0]) is not None]
WITHOUT_API_KEY = [p for p in params_of(ENGINE) if _api_key_ref(p.values[0]) is None]


def test_the_examples_show_an_engine_with_and_one_without_an_api_key() -> None:
    assert WITH_API_KEY and WITHOUT_API_KEY
    assert len(WITH_API_KEY) + len(WITHOUT_API_KEY) == len(ENGINES)


@pytest.mark.parametrize("doc", WITH_API_KEY)
def test_engine_api_key_secret_is_defined_or_its_creation_explained(
    doc: Mapping[str, Any],
) -> None:
    ref = parsed(doc).coordinator.api_key_secret_ref
    assert ref is not None
    # The coordinators read the key from that Secret, and no pod reads another user Secret.
    assert _user_secrets(doc) == {(ref.name, ref.key, "COREFLEET_API_KEY")}
    (file,) = [f for f, _, d in DOCS if d is doc]
    secrets = {name_of(d) for _, _, d in DOCS if d["kind"] == "Secret"}
    text = (EXAMPLES / file).read_text()
    create = f"kubectl create secret generic {ref.name} --from-literal={ref.key}="
    assert ref.name in secrets or create in text, f"{file}: say how to create Secret {ref.name}"


@pytest.mark.parametrize("doc", WITHOUT_API_KEY)
def test_engine_without_an_api_key_needs_no_secret_of_the_user(doc: Mapping[str, Any]) -> None:
    # Its API is open, and nothing waits on a Secret: `kubectl apply -f` of the file alone runs.
    assert parsed(doc).coordinator.api_key_secret_ref is None
    assert _user_secrets(doc) == set()


def test_readme_coordinator_autoscaling_block_applies_to_the_gpu_example() -> None:
    # The README's block, put into llama-gpu.yaml in place of replicas as it says: the CRD
    # accepts it, and the HPA and the Deployment the operator builds are valid Kubernetes.
    readme = (EXAMPLES / "README.md").read_text()
    section = readme.split("## Several coordinators", 1)[1]
    (block,) = re.findall(r"```yaml\n(.*?)```", section, re.S)
    coordinator = yaml.safe_load(block)["spec"]["coordinator"]
    engine = yaml.safe_load(yaml.safe_dump(ENGINES["llama"]))
    del engine["spec"]["coordinator"]["replicas"]
    engine["spec"]["coordinator"].update(coordinator)
    assert engine_errors(engine) == []
    owner = Owner(name=name_of(engine), namespace="default", uid="0b1c2d3e-uid")
    children = {c["kind"]: c for c in resources.build_children(owner, parsed(engine))}
    hpa = children["HorizontalPodAutoscaler"]
    assert k8s_errors(hpa) == [] and k8s_errors(children["Deployment"]) == []
    assert hpa["spec"]["scaleTargetRef"]["name"] == children["Deployment"]["metadata"]["name"]
    assert "replicas" not in children["Deployment"]["spec"]
    # Utilization is relative to the request: the block must set one.
    container = children["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["requests"]["cpu"]


def test_the_gpu_example_runs_several_coordinators_and_the_cpu_example_one() -> None:
    assert parsed(ENGINES["llama"]).coordinator.replicas == 2
    assert parsed(ENGINES["smollm2"]).coordinator.replicas == 1


# -- autoscalers -----------------------------------------------------------------------------


@pytest.mark.parametrize("doc", params_of(("autoscaling/v2", "HorizontalPodAutoscaler")))
def test_hpa_scales_an_example_engine_on_the_waiting_queue(doc: Mapping[str, Any]) -> None:
    spec = doc["spec"]
    engine = target_engine(spec["scaleTargetRef"])
    assert 1 <= spec["minReplicas"] <= spec["maxReplicas"] <= MAX_RANKS
    queue = [m["object"] for m in spec["metrics"] if m["type"] == "Object"]
    assert queue, "no Object metric"
    for metric in queue:
        # The coordinator Service the operator creates for that engine, under the adapter's name.
        assert metric["describedObject"] == {
            "apiVersion": "v1",
            "kind": "Service",
            "name": coordinator_name(name_of(engine)),
        }
        assert metric["metric"]["name"] == adapter_name(WAITING)
    assert_slow_scale_down(spec["behavior"], engine)


def test_adapter_rule_renames_the_waiting_gauge_to_a_legal_name() -> None:
    name = adapter_name(WAITING)
    assert name == "vllm_num_requests_waiting"
    (rule,) = [r for r in adapter_rules() if WAITING in r["seriesQuery"]]
    assert rule["resources"]["overrides"]["service"] == {"resource": "service"}
    assert "<<.LabelMatchers>>" in rule["metricsQuery"]
    assert rule["metricsQuery"].startswith("max(")  # one figure however many coordinators


@pytest.mark.parametrize("doc", params_of(SCALED_OBJECT))
def test_keda_scales_an_example_engine_on_the_waiting_queue(doc: Mapping[str, Any]) -> None:
    spec = doc["spec"]
    engine = target_engine(spec["scaleTargetRef"])
    assert 0 <= spec["minReplicaCount"] <= spec["maxReplicaCount"] <= MAX_RANKS
    assert spec["cooldownPeriod"] > 0 and spec["pollingInterval"] > 0
    (trigger,) = [t for t in spec["triggers"] if t["type"] == "prometheus"]
    meta = trigger["metadata"]
    assert re.match(r"https?://", meta["serverAddress"])
    # max: every coordinator reports the same ranks' queues; a sum counts them once per pod.
    assert meta["query"].startswith(f"max({WAITING}{{")
    assert f'service="{coordinator_name(name_of(engine))}"' in meta["query"]
    assert float(meta["threshold"]) > 0
    assert_slow_scale_down(spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"], engine)


def test_each_engine_has_at_most_one_autoscaler() -> None:
    targets = [
        doc["spec"]["scaleTargetRef"]["name"]
        for _, _, doc in DOCS
        if doc["kind"] in ("HorizontalPodAutoscaler", "ScaledObject")
    ]
    assert len(targets) == len(set(targets)), targets


@pytest.mark.parametrize("doc", params_of(SERVICE_MONITOR))
def test_service_monitor_selects_a_coordinator_service_by_its_labels(
    doc: Mapping[str, Any],
) -> None:
    labels = doc["spec"]["selector"]["matchLabels"]
    engine = ENGINES[labels["corefleet.dev/engine"]]
    owner = Owner(name=name_of(engine), namespace="default", uid="0b1c2d3e-uid")
    services = [
        c
        for c in resources.build_children(owner, parsed(engine))
        if c["kind"] == "Service" and labels.items() <= c["metadata"]["labels"].items()
    ]
    for endpoint in doc["spec"]["endpoints"]:
        assert endpoint["path"] == "/metrics"
        # The labels also select the headless NAME-coordinators, whose only port is the ranks'
        # handshake: exactly one Service, the API's, has the port Prometheus scrapes, so each
        # coordinator pod is scraped once.
        scraped = [
            s["metadata"]["name"]
            for s in services
            if endpoint["port"] in {p["name"] for p in s["spec"]["ports"]}
        ]
        assert scraped == [coordinator_name(name_of(engine))]


# -- GitOps ----------------------------------------------------------------------------------


def _kustomization() -> dict[str, Any]:
    return dict(yaml.safe_load((EXAMPLES / "kustomization.yaml").read_text()))


def test_kustomization_resources_exist() -> None:
    for entry in _kustomization()["resources"]:
        path = (EXAMPLES / entry).resolve()
        assert path.exists(), entry
        # kustomize refuses files outside the kustomization's folder unless told otherwise.
        assert path.is_dir() or path.parent == EXAMPLES, entry


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kustomization_renders_valid_manifests_without_the_rank_count() -> None:
    out = run("kubectl", "kustomize", str(EXAMPLES)).stdout
    docs = [d for d in yaml.safe_load_all(out) if d is not None]
    engines = {name_of(d): d for d in docs if kind_key(d) == ENGINE}
    assert engines, "the kustomization deploys no InferenceEngine"
    for doc in docs:
        if kind_key(doc) == ENGINE:
            assert engine_errors(doc) == [], name_of(doc)
            parsed(doc)
        else:
            assert k8s_errors(doc) == [], f"{doc['kind']} {name_of(doc)}"
    for doc in docs:
        if doc["kind"] == "HorizontalPodAutoscaler":
            target = doc["spec"]["scaleTargetRef"]["name"]
            assert target in engines, f"the HPA targets {target}, which is not in the render"
            # The autoscaler owns the rank count: git must not hold it.
            assert "dataParallelSize" not in engines[target]["spec"]


@pytest.mark.parametrize("doc", params_of(APPLICATION))
def test_argocd_application_leaves_the_rank_count_to_the_autoscaler(
    doc: Mapping[str, Any],
) -> None:
    spec = doc["spec"]
    assert (REPO / spec["source"]["path"] / "kustomization.yaml").is_file()
    assert spec["destination"]["server"] and spec["destination"]["namespace"]
    ignored = [
        d
        for d in spec["ignoreDifferences"]
        if d.get("group") == GROUP
        and d.get("kind") == KIND
        and "/spec/dataParallelSize" in d.get("jsonPointers", ())
    ]
    assert ignored, "no ignoreDifferences on the InferenceEngine's /spec/dataParallelSize"
    assert "RespectIgnoreDifferences=true" in spec["syncPolicy"]["syncOptions"]
