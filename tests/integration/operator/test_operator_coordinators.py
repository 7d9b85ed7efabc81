"""The real operator against a real API server: several coordinators, their budget, discovery
and HPA.

Without the controller manager the test plays the Deployment controller (its status). With it,
the real HPA controller takes the HorizontalPodAutoscaler the operator made; no metrics API runs,
so it only keeps the Deployment within minReplicas..maxReplicas, and the test stands in for the
metric-driven scaling by writing the Deployment's `/scale`, as the HPA controller does.
"""

from __future__ import annotations

from typing import Any

from operator_harness import MERGE, Cluster, engine_manifest, eventually, run
from operator_run import running_operator
from real_cluster import real_cluster

DEPLOYS = "apps/v1/deployments"
HPAS = "autoscaling/v2/horizontalpodautoscalers"
DEPLOY_URL = "/apis/apps/v1/namespaces/default/deployments/llama-coordinator"


def _get(c: Cluster, path: str, name: str) -> dict[str, Any] | None:
    return c.obj(path, "default", name)


def _deployment(c: Cluster) -> dict[str, Any]:
    found = _get(c, DEPLOYS, "llama-coordinator")
    assert found is not None
    return found


def _args(c: Cluster) -> list[str]:
    return list(_deployment(c)["spec"]["template"]["spec"]["containers"][0]["args"])


def _able_to_scale(c: Cluster) -> bool:
    hpa = _get(c, HPAS, "llama-coordinator") or {}
    conditions = (hpa.get("status") or {}).get("conditions") or []
    return any(x["type"] == "AbleToScale" and x["status"] == "True" for x in conditions)


def test_two_coordinators_with_a_budget_and_a_discovery_service(tmp_path):
    async def scenario():
        async with real_cluster(tmp_path) as c, running_operator():
            await c.apply(engine_manifest(ranks=2, coordinator={"replicas": 2}))
            await eventually(
                lambda: _get(c, DEPLOYS, "llama-coordinator") and len(c.pods()) == 2,
                what="coordinator Deployment and ranks",
            )
            spec = _deployment(c)["spec"]
            assert spec["replicas"] == 2
            assert spec["strategy"] == {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
            }
            selector = spec["selector"]["matchLabels"]
            budget = await eventually(
                lambda: _get(c, "policy/v1/poddisruptionbudgets", "llama-coordinator"),
                what="coordinator PDB",
            )
            assert budget["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": selector}}
            peers = await eventually(
                lambda: _get(c, "v1/services", "llama-coordinators"), what="discovery Service"
            )
            assert peers["spec"]["clusterIP"] == "None"
            assert peers["spec"]["publishNotReadyAddresses"] is True
            assert peers["spec"]["selector"] == selector
            http = _get(c, "v1/services", "llama-coordinator")
            assert http is not None  # a real server leaves out a false (omitempty) boolean
            assert http["spec"].get("publishNotReadyAddresses", False) is False
            for pod in c.pods().values():
                args = pod["spec"]["containers"][0]["args"]
                assert args[args.index("--coordinator") + 1] == "llama-coordinators:5570"

            # Play the Deployment controller: one of the two coordinators is Ready.
            ready = {"status": {"replicas": 2, "readyReplicas": 1, "availableReplicas": 1}}
            await c.request("PATCH", f"{DEPLOY_URL}/status", ready, MERGE)
            await eventually(
                lambda: c.status().get("coordinatorSummary") == "1/2", what="coordinators 1/2"
            )
            await c.patch_spec({"coordinator": {"replicas": 3}})
            await eventually(lambda: _deployment(c)["spec"]["replicas"] == 3, what="3 replicas")
            await eventually(
                lambda: c.status().get("coordinatorSummary") == "1/3", what="coordinators 1/3"
            )

    run(scenario())


def test_an_hpa_owns_the_coordinator_count_until_autoscaling_is_removed(tmp_path):
    async def scenario():
        async with (
            real_cluster(tmp_path, controller_manager=True) as c,
            running_operator(),
        ):
            coordinator = {
                "autoscaling": {"minReplicas": 2, "maxReplicas": 5},
                "resources": {"requests": {"cpu": "250m"}},
            }
            await c.apply(engine_manifest(ranks=1, coordinator=coordinator))
            hpa = await eventually(lambda: _get(c, HPAS, "llama-coordinator"), what="the HPA")
            assert hpa["spec"]["scaleTargetRef"] == {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "name": "llama-coordinator",
            }
            assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 5)
            (metric,) = hpa["spec"]["metrics"]
            assert metric["resource"]["target"] == {"type": "Utilization", "averageUtilization": 80}
            assert hpa["metadata"]["ownerReferences"][0]["uid"] == c.engine()["metadata"]["uid"]
            # The real HPA controller reads the Deployment's scale through the HPA's target,
            # and raises the Deployment (created without replicas: 1) to minReplicas.
            await eventually(lambda: _able_to_scale(c), what="the HPA controller's AbleToScale")
            await eventually(lambda: _deployment(c)["spec"]["replicas"] == 2, what="2 replicas")

            # Metrics would make it scale the Deployment through its scale subresource.
            await c.request("PATCH", f"{DEPLOY_URL}/scale", {"spec": {"replicas": 4}}, MERGE)
            # A spec change that updates the Deployment (its args): the HPA's count stays.
            await c.patch_spec({"coordinator": {"routing": "PrefixHash"}})
            await eventually(lambda: "prefix-hash" in _args(c), what="Deployment updated")
            assert _deployment(c)["spec"]["replicas"] == 4
            # The timer and pod events reconcile again and again; none of them resets it.
            generation = _deployment(c)["metadata"]["generation"]
            await c.patch_spec({"coordinator": {"autoscaling": {"maxReplicas": 6}}})
            await eventually(
                lambda: _get(c, HPAS, "llama-coordinator")["spec"]["maxReplicas"] == 6,
                what="HPA updated",
            )
            assert _deployment(c)["spec"]["replicas"] == 4
            assert _deployment(c)["metadata"]["generation"] == generation  # not even patched

            # Without autoscaling the spec's count is back, and the HPA goes.
            await c.patch_spec({"coordinator": {"autoscaling": None, "replicas": 2}})
            await eventually(lambda: _get(c, HPAS, "llama-coordinator") is None, what="HPA deleted")
            await eventually(lambda: _deployment(c)["spec"]["replicas"] == 2, what="2 replicas")

    run(scenario())
