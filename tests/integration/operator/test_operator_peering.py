"""Leader election through kopf peering, with the peering CRDs shipped in crds/."""

from __future__ import annotations

import yaml
from operator_harness import REPO, cluster, engine_manifest, eventually, run, running_operator

PEERING = list(yaml.safe_load_all((REPO / "crds" / "kopf-peering.yaml").read_text()))
PEERING_URL = "/apis/kopf.dev/v1/clusterkopfpeerings"


def test_cluster_wide_operator_joins_its_peering_and_reconciles(tmp_path):
    async def scenario():
        async with cluster(tmp_path / "kubeconfig") as c:
            crds = [d for d in PEERING if d["kind"] == "CustomResourceDefinition"]
            assert {d["spec"]["names"]["kind"] for d in crds} == {
                "KopfPeering",
                "ClusterKopfPeering",
            }
            for crd in crds:  # registered through the API, as `kubectl apply` would
                await c.request(
                    "POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd
                )
            (peering,) = [d for d in PEERING if d["kind"] == "ClusterKopfPeering"]
            await c.request("POST", PEERING_URL, peering)

            def peers():
                obj = c.emu.obj("kopf.dev/v1/clusterkopfpeerings", "", "corefleet-operator")
                return (obj or {}).get("status") or {}

            async with running_operator(
                namespaces=[],
                clusterwide=True,
                standalone=False,
                peering_name="corefleet-operator",
                priority=7,
            ):
                found = await eventually(peers, what="operator listed in the peering")
                assert [p["priority"] for p in found.values()] == [7]
                await c.apply(engine_manifest(ranks=1))
                await eventually(lambda: 0 in c.pods(), what="rank created")
            await eventually(lambda: not peers(), what="operator left the peering")

    run(scenario())
