"""The Helm chart `charts/corefleet`, rendered by the real helm and checked offline.

Every test renders with `helm template` (no cluster, no network) and reads the manifests back
with PyYAML; `kubernetes-validate` checks them against the Kubernetes API schemas it ships.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.tools import CHART, CRD_FILE, REPO, run, tool

RELEASE = "corefleet"
NAMESPACE = "corefleet-system"
PEERING_CRDS = REPO / "crds" / "kopf-peering.yaml"
KEEP = "helm.sh/resource-policy"

# Every optional feature switched away from its default, and every pass-through block filled.
NON_DEFAULT: dict[str, Any] = {
    "image": {"tag": "0.1.1", "pullPolicy": "Always"},
    "imagePullSecrets": [{"name": "registry-credentials"}],
    "replicaCount": 2,
    "watchNamespaces": ["a", "b"],
    "crds": {"install": True, "keep": False},
    "verbose": True,
    "env": [{"name": "COREFLEET_OPERATOR_TIMER_SECONDS", "value": "5"}],
    "serviceAccount": {"annotations": {"iam.example.com/role": "corefleet"}},
    "healthService": {"enabled": True, "port": 9000},
    "livenessProbe": {"initialDelaySeconds": 3, "periodSeconds": 7},
    "resources": {
        "requests": {"cpu": "250m", "memory": "256Mi", "example.com/widget": "1"},
        "limits": {"cpu": "2", "memory": "1Gi"},
    },
    "nodeSelector": {"kubernetes.io/os": "linux", "pool": "system"},
    "tolerations": [
        {"key": "dedicated", "operator": "Equal", "value": "system", "effect": "NoSchedule"},
        {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "tolerationSeconds": 30},
    ],
    "affinity": {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["system"]}]}
                ]
            }
        }
    },
    "podAnnotations": {"example.com/scrape": "false"},
    "podLabels": {"team": "inference"},
}
VALUE_SETS = {"default": {}, "non-default": NON_DEFAULT}

Rule = tuple[str, str, frozenset[str]]


def _rules(*rows: tuple[str, str, str]) -> set[Rule]:
    return {(group, resource, frozenset(verbs.split())) for group, resource, verbs in rows}


# What the operator calls, with the code that calls it. A new rule in the chart fails
# test_rbac_grants_only_what_the_operator_uses until it is added here, on purpose.
OBJECT_RULES = _rules(
    ("", "pods", "list watch create patch delete"),  # main.py rank_pods; reconcile.py actions
    ("", "services", "list watch create patch"),  # main.py CHILD_KINDS; _children_actions
    ("", "configmaps", "list watch create patch"),  # same
    ("apps", "deployments", "list watch create patch"),  # same
    ("policy", "poddisruptionbudgets", "list watch create patch"),  # same
    ("networking.k8s.io", "networkpolicies", "list watch create patch"),  # same
    # main.py CHILD_KINDS; _children_actions, which deletes it when autoscaling is removed
    ("autoscaling", "horizontalpodautoscalers", "list watch create patch delete"),
    ("", "secrets", "list watch create get"),  # CURVE Secret; the API key (controller.py)
    ("", "persistentvolumeclaims", "get"),  # controller.py _volume_missing
    ("corefleet.dev", "inferenceengines", "list watch patch"),  # kopf: watch, annotations
    ("corefleet.dev", "inferenceengines/status", "patch"),  # controller.py _write_status
    ("corefleet.dev", "inferenceengines/finalizers", "update"),  # blockOwnerDeletion (resources.py)
    ("", "events", "create"),  # kopf.event in controller.py _post
)
CRD_READS = _rules(
    ("apiextensions.k8s.io", "customresourcedefinitions", "list watch"),  # kopf resource observer
)
NAMESPACE_READS = _rules(("", "namespaces", "list watch"))  # kopf namespace observer (namespaced)
# kopf peering (list watch patch); get: the start-up check of cli.py (peering.py find_problems)
CLUSTER_PEERING = _rules(("kopf.dev", "clusterkopfpeerings", "get list watch patch"))
NAMESPACED_PEERING = _rules(("kopf.dev", "kopfpeerings", "get list watch patch"))  # per namespace


# --- helpers -------------------------------------------------------------------------------------


def helm(*args: str, check: bool = True):
    return run(tool("helm"), *args, check=check)


def values_file(tmp_path: Path, values: dict[str, Any]) -> Path:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def render(tmp_path: Path, values: dict[str, Any] | None = None, *extra: str) -> list[dict]:
    """`helm template` of the chart, as parsed documents (empty ones dropped)."""
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, *extra]
    if values:
        args += ["--values", str(values_file(tmp_path, values))]
    out = helm(*args).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [doc for doc in docs if doc["kind"] == kind]


def only(docs: list[dict], kind: str) -> dict:
    found = of_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def operator_container(docs: list[dict]) -> dict:
    (container,) = only(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return container


def rule_set(role: dict) -> set[Rule]:
    rules = set()
    for rule in role["rules"]:
        assert not rule.get("resourceNames") and not rule.get("nonResourceURLs")
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                rules.add((group, resource, frozenset(rule["verbs"])))
    return rules


def chart_meta() -> dict:
    return yaml.safe_load((CHART / "Chart.yaml").read_text())


def minimum_kube_version() -> str:
    match = re.fullmatch(r">=(\d+\.\d+\.\d+)-0", chart_meta()["kubeVersion"])
    assert match, "kubeVersion should be a plain lower bound"
    return match.group(1)


# --- the chart as a whole ------------------------------------------------------------------------


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_helm_lint_passes(tmp_path: Path, values: dict[str, Any]) -> None:
    args = ["lint", str(CHART), "--strict", "--namespace", NAMESPACE]
    if values:
        args += ["--values", str(values_file(tmp_path, values))]
    helm(*args)


@pytest.mark.parametrize("kube_version", [minimum_kube_version(), "1.37.0"])
@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_every_rendered_manifest_validates_against_the_kubernetes_schemas(
    tmp_path: Path, values: dict[str, Any], kube_version: str
) -> None:
    docs = render(tmp_path, values, "--kube-version", kube_version)
    # kopf's peering objects have no schema in kubernetes-validate: the peering test checks them.
    builtin = [doc for doc in docs if not doc["apiVersion"].startswith("kopf.dev/")]
    manifests = tmp_path / "manifests.yaml"
    manifests.write_text(yaml.safe_dump_all(builtin))
    result = run(
        tool("kubernetes-validate"), "-k", kube_version, "--strict", "--quiet", str(manifests)
    )
    assert "WARN" not in result.stdout + result.stderr, result.stdout + result.stderr


def test_an_older_kubernetes_than_the_chart_supports_is_refused(tmp_path: Path) -> None:
    result = helm("template", RELEASE, str(CHART), "--kube-version", "1.27.9", check=False)
    assert result.returncode != 0
    assert "kubeVersion" in result.stderr


def test_templates_stay_small() -> None:
    for template in (CHART / "templates").iterdir():
        lines = len(template.read_text().splitlines())
        assert lines <= 150, f"{template.name} has {lines} lines; split it"


# --- values and schema ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "assignment", ["nope=1", "image.tagg=v1", "crds.enabled=true", "healthService.prot=1"]
)
def test_an_unknown_values_key_is_rejected_by_the_schema(assignment: str) -> None:
    result = helm("template", RELEASE, str(CHART), "--set", assignment, check=False)
    assert result.returncode != 0
    key = assignment.split("=")[0].rsplit(".", 1)[-1]
    assert f"Additional property {key} is not allowed" in result.stderr


def test_every_values_key_has_a_comment_and_a_schema_entry() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    lines = (CHART / "values.yaml").read_text().splitlines()
    stack: list[tuple[int, str]] = []  # (indent, key) of the enclosing keys
    for number, line in enumerate(lines):
        match = re.match(r"^( *)([A-Za-z][\w.-]*):", line)
        if not match:
            continue
        indent, key = len(match.group(1)), match.group(2)
        stack = [(i, k) for i, k in stack if i < indent]
        node: dict[str, Any] | None = schema
        for _, parent in stack:
            node = (node or {}).get("properties", {}).get(parent)
        stack.append((indent, key))
        if node is None or "properties" not in node:
            continue  # inside a pass-through block such as resources: free-form by design
        assert key in node["properties"], f"values.yaml key {key} is missing from the schema"
        previous = next(p for p in reversed(lines[:number]) if p.strip())
        assert previous.strip().startswith("#"), f"values.yaml key {key} has no comment"


# --- RBAC ----------------------------------------------------------------------------------------


def test_cluster_wide_install_uses_a_cluster_role(tmp_path: Path) -> None:
    docs = render(tmp_path)
    role = only(docs, "ClusterRole")
    binding = only(docs, "ClusterRoleBinding")
    assert not of_kind(docs, "Role") and not of_kind(docs, "RoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }
    account = only(docs, "ServiceAccount")["metadata"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["name"], "namespace": NAMESPACE}
    ]
    assert "--all-namespaces" in operator_container(docs)["args"]


def test_rbac_narrows_to_a_role_per_watched_namespace_when_watch_namespaces_is_set(
    tmp_path: Path,
) -> None:
    docs = render(tmp_path, {"watchNamespaces": ["a", "b"]})
    roles = of_kind(docs, "Role")
    bindings = of_kind(docs, "RoleBinding")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["a", "b"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["a", "b"]
    for binding in bindings:
        assert binding["roleRef"]["kind"] == "Role"
        assert binding["subjects"][0]["namespace"] == NAMESPACE
    # What stays cluster-wide is read-only and touches no namespaced object.
    for cluster_role in of_kind(docs, "ClusterRole"):
        for _group, resource, verbs in rule_set(cluster_role):
            assert verbs <= {"get", "list", "watch"}, (resource, verbs)
            assert resource in {"customresourcedefinitions", "namespaces"}, resource
    args = operator_container(docs)["args"]
    assert [a for a in args if a.startswith("--namespace")] == ["--namespace=a", "--namespace=b"]
    assert "--all-namespaces" not in args


@pytest.mark.parametrize("replicas", [1, 2])
def test_rbac_grants_only_what_the_operator_uses(tmp_path: Path, replicas: int) -> None:
    peering = replicas > 1
    cluster_wide = render(tmp_path, {"replicaCount": replicas})
    expected = OBJECT_RULES | CRD_READS | (CLUSTER_PEERING if peering else set())
    assert rule_set(only(cluster_wide, "ClusterRole")) == expected

    namespaced = render(tmp_path, {"replicaCount": replicas, "watchNamespaces": ["a", "b"]})
    assert rule_set(only(namespaced, "ClusterRole")) == CRD_READS | NAMESPACE_READS
    for role in of_kind(namespaced, "Role"):
        assert rule_set(role) == OBJECT_RULES | (NAMESPACED_PEERING if peering else set())


# --- CRDs ----------------------------------------------------------------------------------------


def test_the_crd_can_be_turned_off(tmp_path: Path) -> None:
    assert of_kind(render(tmp_path), "CustomResourceDefinition")
    docs = render(tmp_path, {"crds": {"install": False}})
    assert not of_kind(docs, "CustomResourceDefinition")


def test_crds_keep_adds_the_helm_keep_annotation(tmp_path: Path) -> None:
    kept = only(render(tmp_path, {"crds": {"keep": True}}), "CustomResourceDefinition")
    assert kept["metadata"]["annotations"] == {KEEP: "keep"}
    dropped = only(render(tmp_path, {"crds": {"keep": False}}), "CustomResourceDefinition")
    assert KEEP not in (dropped["metadata"].get("annotations") or {})


@pytest.mark.parametrize("keep", [True, False])
def test_the_charts_crd_equals_the_one_in_crds(tmp_path: Path, keep: bool) -> None:
    copy = CHART / "files" / CRD_FILE.name
    assert copy.read_bytes() == CRD_FILE.read_bytes(), f"run: cp {CRD_FILE} {copy}"
    rendered = only(render(tmp_path, {"crds": {"keep": keep}}), "CustomResourceDefinition")
    annotations = rendered["metadata"].pop("annotations", {})
    annotations.pop(KEEP, None)
    if annotations:
        rendered["metadata"]["annotations"] = annotations
    assert rendered == yaml.safe_load(CRD_FILE.read_text())


# --- the operator pod ----------------------------------------------------------------------------


def test_security_context_defaults_non_root_read_only_no_capabilities_no_escalation(
    tmp_path: Path,
) -> None:
    docs = render(tmp_path)
    pod = only(docs, "Deployment")["spec"]["template"]["spec"]
    container = operator_container(docs)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert isinstance(pod["securityContext"]["runAsUser"], int)
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    context = container["securityContext"]
    assert context["readOnlyRootFilesystem"] is True
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"]}
    # The read-only root still leaves a writable /tmp.
    (mount,) = container["volumeMounts"]
    assert mount["mountPath"] == "/tmp"
    assert {"name": mount["name"], "emptyDir": {"sizeLimit": "64Mi"}} in pod["volumes"]


def test_image_tag_defaults_to_the_charts_app_version_never_latest(tmp_path: Path) -> None:
    image = operator_container(render(tmp_path))["image"]
    assert image == f"ghcr.io/corefleet/corefleet-operator:{chart_meta()['appVersion']}"
    pinned = operator_container(render(tmp_path, {"image": {"tag": "0.2.0"}}))["image"]
    assert pinned.endswith(":0.2.0")
    result = helm("template", RELEASE, str(CHART), "--set", "image.tag=latest", check=False)
    assert result.returncode != 0 and "image.tag" in result.stderr


def test_pass_through_blocks_are_rendered_verbatim(tmp_path: Path) -> None:
    docs = render(tmp_path, NON_DEFAULT)
    pod = only(docs, "Deployment")["spec"]["template"]
    container = operator_container(docs)
    assert container["resources"] == NON_DEFAULT["resources"]
    assert container["env"] == NON_DEFAULT["env"]
    assert pod["spec"]["tolerations"] == NON_DEFAULT["tolerations"]
    assert pod["spec"]["affinity"] == NON_DEFAULT["affinity"]
    assert pod["spec"]["nodeSelector"] == NON_DEFAULT["nodeSelector"]
    assert pod["spec"]["imagePullSecrets"] == NON_DEFAULT["imagePullSecrets"]
    assert pod["metadata"]["annotations"] == NON_DEFAULT["podAnnotations"]
    assert pod["metadata"]["labels"]["team"] == "inference"
    account = only(docs, "ServiceAccount")["metadata"]
    assert account["annotations"] == NON_DEFAULT["serviceAccount"]["annotations"]


def test_the_liveness_probe_and_health_service_use_the_operators_liveness_endpoint(
    tmp_path: Path,
) -> None:
    assert not of_kind(render(tmp_path), "Service")
    docs = render(tmp_path, {"healthService": {"enabled": True, "port": 9000}})
    container = operator_container(docs)
    assert "--liveness=http://0.0.0.0:8080/healthz" in container["args"]
    assert container["ports"] == [{"name": "health", "containerPort": 8080, "protocol": "TCP"}]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    service = only(docs, "Service")
    assert service["spec"]["ports"] == [
        {"name": "health", "port": 9000, "targetPort": "health", "protocol": "TCP"}
    ]
    pod_labels = only(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()


def test_one_replica_runs_standalone_and_is_replaced_not_overlapped(tmp_path: Path) -> None:
    docs = render(tmp_path)
    assert "--standalone" in operator_container(docs)["args"]
    assert "--require-peering" not in operator_container(docs)["args"]
    assert only(docs, "Deployment")["spec"]["strategy"] == {"type": "Recreate"}
    assert not [doc for doc in docs if doc["apiVersion"].startswith("kopf.dev/")]


@pytest.mark.parametrize("namespaces", [[], ["a", "b"]])
def test_several_replicas_elect_a_leader_through_kopf_peering(
    tmp_path: Path, namespaces: list[str]
) -> None:
    docs = render(tmp_path, {"replicaCount": 2, "watchNamespaces": namespaces})
    args = operator_container(docs)["args"]
    assert "--standalone" not in args
    assert f"--peering={RELEASE}" in args
    # A replica without its peering object exits with an error instead of waiting silently.
    assert "--require-peering" in args
    assert only(docs, "Deployment")["spec"]["strategy"] == {"type": "RollingUpdate"}
    peerings = [doc for doc in docs if doc["apiVersion"].startswith("kopf.dev/")]
    assert {doc["metadata"]["name"] for doc in peerings} == {RELEASE}
    # Each peering object is of a kind that crds/kopf-peering.yaml defines, at the right scope.
    crds = of_kind(list(yaml.safe_load_all(PEERING_CRDS.read_text())), "CustomResourceDefinition")
    scopes = {
        (f"{crd['spec']['group']}/{v['name']}", crd["spec"]["names"]["kind"]): crd["spec"]["scope"]
        for crd in crds
        for v in crd["spec"]["versions"]
    }
    for doc in peerings:
        scope = scopes[(doc["apiVersion"], doc["kind"])]
        assert ("namespace" in doc["metadata"]) == (scope == "Namespaced")
    if namespaces:
        assert sorted(doc["metadata"]["namespace"] for doc in peerings) == namespaces
    else:
        assert [doc["kind"] for doc in peerings] == ["ClusterKopfPeering"]


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_the_rendered_command_line_is_accepted_by_corefleet_operator(
    tmp_path: Path, values: dict[str, Any]
) -> None:
    pytest.importorskip("kopf", reason="the operator extra is not installed")
    from corefleet.operator.cli import kopf_args

    container = operator_container(render(tmp_path, values))
    assert container["command"] == ["corefleet-operator"]
    kopf = kopf_args(container["args"])
    namespaces = values.get("watchNamespaces")
    if namespaces:
        assert kopf[kopf.index("--namespace") + 1] == namespaces[0]
    else:
        assert "--all-namespaces" in kopf
    assert kopf[kopf.index("--liveness") + 1] == "http://0.0.0.0:8080/healthz"
