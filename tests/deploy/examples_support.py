"""What the example checks share: the documents of examples/, their kinds, and the checks a
cluster would run on them (Kubernetes schemas, the CRD, the operator's parser). Used by
test_examples.py.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from corefleet.operator.spec import API_VERSION, GROUP, KIND, EngineSpec, InvalidSpec, parse_spec
from tests.deploy.tools import CRD_FILE, REPO
from tests.unit.operator import crdcheck

EXAMPLES = REPO / "examples"
K8S_VERSION = "1.30"  # the oldest Kubernetes the examples are meant for
WAITING = "vllm:num_requests_waiting"

CRD = yaml.safe_load(CRD_FILE.read_text())
SERVED = {f"{GROUP}/{v['name']}" for v in CRD["spec"]["versions"] if v["served"]}
MAX_RANKS = crdcheck.SCHEMA["properties"]["spec"]["properties"]["dataParallelSize"]["maximum"]

# Kinds whose schemas kubernetes-validate does not have; each has its own checks in
# test_examples.py.
ENGINE = (API_VERSION, KIND)
SCALED_OBJECT = ("keda.sh/v1alpha1", "ScaledObject")
APPLICATION = ("argoproj.io/v1alpha1", "Application")
SERVICE_MONITOR = ("monitoring.coreos.com/v1", "ServiceMonitor")
KUSTOMIZATION = ("kustomize.config.k8s.io/v1beta1", "Kustomization")
HAND_CHECKED = {ENGINE, SCALED_OBJECT, APPLICATION, SERVICE_MONITOR, KUSTOMIZATION}

FILES = sorted(EXAMPLES.glob("*.yaml"))


def load_docs(path: Path) -> list[Any]:
    """The YAML documents of one file, empty ones left out."""
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def collect_docs() -> list[tuple[str, int, Any]]:
    """(file name, index, document) for every document of examples/ that parses."""
    out = []
    for path in FILES:
        try:
            docs = load_docs(path)
        except yaml.YAMLError:
            continue  # test_every_file_parses names the file
        out += [(path.name, i, doc) for i, doc in enumerate(docs)]
    return out


DOCS = collect_docs()


def kind_key(doc: Any) -> tuple[str, str]:
    """(apiVersion, kind) of a document; empty strings for one that is not a mapping."""
    return (doc.get("apiVersion", ""), doc.get("kind", "")) if isinstance(doc, dict) else ("", "")


def name_of(doc: Mapping[str, Any]) -> str:
    """metadata.name of a document ("" without one)."""
    return str((doc.get("metadata") or {}).get("name", ""))


def doc_id(file: str, index: int, doc: Any) -> str:
    """A test id for a document: file#index:Kind/name."""
    name = name_of(doc) if isinstance(doc, dict) else ""
    return f"{file}#{index}:{kind_key(doc)[1] or '?'}" + (f"/{name}" if name else "")


def params_of(*keys: tuple[str, str]) -> list[Any]:
    """The documents of the given kinds (all when none given), one test id per document."""
    return [
        pytest.param(doc, id=doc_id(file, i, doc))
        for file, i, doc in DOCS
        if not keys or kind_key(doc) in keys
    ]


def builtin_params() -> list[Any]:
    """The documents of kinds the Kubernetes schemas cover, one test id per document."""
    return [
        pytest.param(doc, id=doc_id(file, i, doc))
        for file, i, doc in DOCS
        if kind_key(doc) not in HAND_CHECKED
    ]


ENGINES: dict[str, Mapping[str, Any]] = {
    name_of(doc): doc for _, _, doc in DOCS if kind_key(doc)[1] == KIND
}


# -- shared checks -------------------------------------------------------------------------


def k8s_errors(obj: Mapping[str, Any]) -> list[str]:
    """Why the Kubernetes schemas refuse `obj` (strict: unknown fields too)."""
    try:
        kubernetes_validate.validate(dict(obj), K8S_VERSION, strict=True)
    except kubernetes_validate.SchemaNotFoundError as exc:
        return [exc.message]
    except kubernetes_validate.ValidationError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        return [f"{exc.message} (at /{where})"]
    return []


def unknown_fields(value: Any, schema: Mapping[str, Any], path: str = "") -> Iterator[str]:
    """Fields the CRD does not declare: kubectl's strict field validation refuses them, and
    without it the API server drops them silently."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return
    if isinstance(value, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, sub in value.items():
            if props is not None and key in props:
                yield from unknown_fields(sub, props[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                yield from unknown_fields(sub, extra, f"{path}.{key}")
            elif props is not None:
                yield f"{path}.{key}"
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            yield from unknown_fields(item, schema["items"], f"{path}[{i}]")


def engine_errors(doc: Mapping[str, Any]) -> list[str]:
    """Why the API server (schema, CEL, unknown fields) would refuse an InferenceEngine."""
    found = list(crdcheck.errors(doc))
    found += [f"unknown field {f}" for f in unknown_fields(doc, crdcheck.SCHEMA)]
    if doc.get("apiVersion") not in SERVED:
        found.append(f"apiVersion {doc.get('apiVersion')!r} is not served ({sorted(SERVED)})")
    return found


def parsed(doc: Mapping[str, Any]) -> EngineSpec:
    """The operator's view of the engine, both as written and as the API server defaults it."""
    try:
        parse_spec(crdcheck.defaulted(doc)["spec"])
        return parse_spec(doc["spec"])
    except InvalidSpec as exc:
        pytest.fail(f"the operator refuses {name_of(doc)}: {exc}")


def adapter_name(series: str) -> str:
    """The custom-metrics name prometheus-adapter-rules.yaml gives a Prometheus series."""
    for rule in adapter_rules():
        if series in rule["seriesQuery"]:
            as_ = rule["name"]["as"].replace("${1}", r"\1")
            return re.sub(rule["name"]["matches"], as_, series)
    pytest.fail(f"no rule in prometheus-adapter-rules.yaml publishes {series}")


def adapter_rules() -> list[dict[str, Any]]:
    """The rules of prometheus-adapter-rules.yaml's config."""
    (config,) = [
        doc
        for doc in load_docs(EXAMPLES / "prometheus-adapter-rules.yaml")
        if doc.get("kind") == "ConfigMap"
    ]
    return list(yaml.safe_load(config["data"]["config.yaml"])["rules"])


def target_engine(ref: Mapping[str, Any]) -> Mapping[str, Any]:
    """The InferenceEngine a scaleTargetRef names: one defined in examples/, at a served version."""
    assert ref.get("kind") == KIND, ref
    assert ref.get("apiVersion") in SERVED, f"{ref.get('apiVersion')} is not served by the CRD"
    assert ref.get("name") in ENGINES, f"{ref.get('name')!r} is no InferenceEngine in examples/"
    return ENGINES[ref["name"]]


def assert_slow_scale_down(behavior: Mapping[str, Any], engine: Mapping[str, Any]) -> None:
    """Ranks leave slowly: the window outlasts a drain, and at most one rank per period."""
    down = behavior["scaleDown"]
    drain = parsed(engine).shutdown.effective_timeout_seconds
    assert down["stabilizationWindowSeconds"] >= max(300, drain), down
    assert all(p["type"] == "Pods" and p["value"] == 1 for p in down["policies"]), down
