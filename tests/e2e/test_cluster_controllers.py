"""What the real kube-controller-manager does with an InferenceEngine's children.

The operator runs as the chart's ServiceAccount against a real control plane; no node runs, so
rank pods stay Pending, and where a controller needs Ready pods the test plays the kubelet
(a status PATCH as the admin). Checked: the HPA controller scales an engine through its scale
subresource (`examples/hpa.yaml`, as written) and the coordinator Deployment through the
operator's own HPA; the disruption controller computes the ranks' PodDisruptionBudget and the
Eviction API refuses an eviction it would break; deleting the engine leaves the garbage
collector nothing to miss.
"""

from __future__ import annotations

import datetime
import json
import pathlib
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from control_plane import REPO, ControlPlane
from e2e_support import CRD_FILE, wait_until
from operator_identity import install_chart, operator

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
EXAMPLE = REPO / "examples" / "smollm2-cpu.yaml"
IE = "corefleet.dev/v1alpha1/inferenceengines"
PODS = "/api/v1/namespaces/default/pods"
MERGE = "application/merge-patch+json"


@pytest.fixture
def cluster(tmp_path: pathlib.Path) -> Iterator[ControlPlane]:
    """A control plane (no scheduler: no node) with the operator as the chart installs it."""
    # The CRD before the controller manager (as the chart installed earlier would leave it):
    # the garbage collector and the disruption controller know the kind from their start.
    with ControlPlane(tmp_path / "api", scheduler=False, crds=[CRD_FILE]) as api:
        install_chart(api)
        binary = pathlib.Path(sys.executable).parent / "corefleet-operator"
        command = [str(binary), "--standalone", "--all-namespaces", "--liveness="]
        with operator(api, command, tmp_path / "operator.log", "only"):
            yield api


def _engine(api: ControlPlane) -> dict[str, Any]:
    return api.obj(IE, "default", "smollm2") or {}


def _rank_pods(api: ControlPlane) -> list[str]:
    pods = api.objs("v1/pods", "default", "corefleet.dev/engine=smollm2,corefleet.dev/rank")
    return sorted(p["metadata"]["name"] for p in pods if not p["metadata"].get("deletionTimestamp"))


def test_an_hpa_scales_the_engine_through_its_scale_subresource(cluster: ControlPlane) -> None:
    cluster.kubectl("apply", "-f", str(EXAMPLE))
    cluster.kubectl("scale", "ie/smollm2", "--replicas=1")
    wait_until(lambda: _rank_pods(cluster) == ["smollm2-engine-0"], 60, 0.5, "one rank")
    # examples/hpa.yaml as written: its metric has no adapter here, but below minReplicas the
    # HPA controller scales up without one, through /scale.
    cluster.kubectl("apply", "-f", str(REPO / "examples" / "hpa.yaml"))
    wait_until(lambda: _engine(cluster)["spec"]["dataParallelSize"] == 2, 60, 0.5, "the HPA")
    wait_until(lambda: len(_rank_pods(cluster)) == 2, 60, 0.5, "rank 1's pod")
    hpa = cluster.obj("autoscaling/v2/horizontalpodautoscalers", "default", "smollm2") or {}
    conditions = {c["type"]: c for c in (hpa.get("status") or {}).get("conditions") or []}
    assert conditions["AbleToScale"]["status"] == "True", conditions
    scale = cluster.get(
        "/apis/corefleet.dev/v1alpha1/namespaces/default/inferenceengines/smollm2/scale"
    )
    assert scale is not None and scale["spec"]["replicas"] == 2
    assert "corefleet.dev/engine=smollm2" in scale["status"]["selector"], scale


def test_the_operators_hpa_scales_the_coordinators(cluster: ControlPlane) -> None:
    cluster.kubectl("apply", "-f", str(EXAMPLE))
    autoscaling = {"spec": {"coordinator": {"autoscaling": {"minReplicas": 2, "maxReplicas": 3}}}}
    cluster.kubectl("patch", "ie/smollm2", "--type=merge", "-p", json.dumps(autoscaling))

    def replicas() -> int:
        deployment = cluster.obj("apps/v1/deployments", "default", "smollm2-coordinator") or {}
        return int((deployment.get("spec") or {}).get("replicas") or 0)

    wait_until(lambda: replicas() == 2, 90, 0.5, "the coordinator HPA to scale to 2")
    pods = cluster.objs("v1/pods", "default", "app.kubernetes.io/component=coordinator")
    wait_until(
        lambda: (
            len(cluster.objs("v1/pods", "default", "app.kubernetes.io/component=coordinator")) == 2
        ),
        60,
        0.5,
        f"two coordinator pods (have {len(pods)})",
    )


def _ready(api: ControlPlane, name: str) -> None:
    """Play the kubelet: the pod Running and Ready, probed just now (a new pod event)."""
    probed = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    ready = {"type": "Ready", "status": "True", "lastProbeTime": probed}
    api.patch_status("v1/pods", "default", name, {"phase": "Running", "conditions": [ready]})


def _evict(api: ControlPlane, name: str) -> tuple[int, Any]:
    body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name}}
    return api.request("POST", f"{PODS}/{name}/eviction", body)


def test_the_rank_budget_lets_one_rank_go_at_a_time(cluster: ControlPlane) -> None:
    cluster.kubectl("apply", "-f", str(EXAMPLE))
    wait_until(lambda: len(_rank_pods(cluster)) == 2, 60, 0.5, "two rank pods")
    for name in _rank_pods(cluster):
        _ready(cluster, name)

    def allowed() -> int | None:
        budget = cluster.obj("policy/v1/poddisruptionbudgets", "default", "smollm2-engine") or {}
        status = budget.get("status") or {}
        return status.get("disruptionsAllowed") if status.get("currentHealthy") == 2 else None

    # With maxUnavailable the disruption controller reads the expected count from the pods'
    # owner's scale subresource: the InferenceEngine's. Until its RESTMapper, refreshed every
    # 30 s, knows the kind (its CRD was installed a moment ago), the sync fails with "no matches
    # for kind", and the budget is synced again only on the next pod event. A kubelet posts one
    # as its probes run; so does this loop (once a second).
    def allowed_after_a_probe() -> int | None:
        found = allowed()
        if found is None:
            for name in _rank_pods(cluster):
                _ready(cluster, name)
        return found

    wait_until(lambda: allowed_after_a_probe() == 1, 120, 1.0, "the disruption controller")
    status, _ = _evict(cluster, "smollm2-engine-0")
    assert status == 201
    # Rank 0 comes back (the operator recreates it) but is not Ready: no second eviction.
    wait_until(lambda: "smollm2-engine-0" in _rank_pods(cluster), 60, 0.5, "rank 0 again")
    budget_path = "policy/v1/poddisruptionbudgets"
    wait_until(
        lambda: (
            ((cluster.obj(budget_path, "default", "smollm2-engine") or {}).get("status") or {}).get(
                "currentHealthy"
            )
            == 1
        ),
        60,
        0.5,
        "the budget to count one healthy rank",
    )
    status, answer = _evict(cluster, "smollm2-engine-1")
    assert status == 429, answer
    assert "disruption budget" in answer["message"], answer


def test_deleting_the_engine_leaves_the_garbage_collector_nothing_to_miss(
    cluster: ControlPlane,
) -> None:
    cluster.kubectl("apply", "-f", str(EXAMPLE))
    kinds = [
        "v1/pods",
        "v1/services",
        "v1/configmaps",
        "v1/secrets",
        "apps/v1/deployments",
        "apps/v1/replicasets",
        "policy/v1/poddisruptionbudgets",
        "networking.k8s.io/v1/networkpolicies",
    ]

    def owned() -> list[str]:
        found = []
        for kind in kinds:
            for obj in cluster.objs(kind, "default"):
                labels = obj["metadata"].get("labels") or {}
                if labels.get("corefleet.dev/engine") == "smollm2":
                    found.append(f"{kind}/{obj['metadata']['name']}")
        return found

    wait_until(lambda: len(owned()) >= 12, 60, 0.5, "every child")
    cluster.kubectl("delete", "ie", "smollm2", "--wait=true", "--timeout=60s", timeout=90)
    wait_until(lambda: not owned(), 90, 0.5, "the garbage collector")
