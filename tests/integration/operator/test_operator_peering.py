"""Leader election through kopf peering, on a real API server: the CRDs in crds/, the objects in
deploy/peering/, and `corefleet-operator`'s start-up check, which never lets a missing peering
object hang it. The operator has the chart's RBAC for several replicas (`replicaCount=2`, which
adds the peering rules): a ClusterRole for `-A`, a Role in `default` for `-n default`."""

from __future__ import annotations

import pytest
import yaml
from chart_install import CLUSTER_WIDE_PEERED, NAMESPACED_PEERED
from operator_harness import REPO, engine_manifest, eventually, run
from operator_run import lines_with, operator_process, running_operator
from real_cluster import PEERING_CRDS, RealCluster, real_cluster

PEERING_OBJECTS = REPO / "deploy" / "peering"
KOPF = "/apis/kopf.dev/v1"
NAMESPACED = "kopf.dev/v1/kopfpeerings"
CLUSTER = "kopf.dev/v1/clusterkopfpeerings"
CREATE_IN_DEFAULT = (
    'echo \'{"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name":'
    ' "corefleet-operator", "namespace": "default"}}\' | kubectl apply -f -'
)


def peering_object(kind_file: str, namespace: str | None = None) -> dict:
    """The object of a deploy/peering/ file, placed like `kubectl apply -n NAMESPACE` would."""
    obj = yaml.safe_load((PEERING_OBJECTS / kind_file).read_text())
    if namespace is not None:
        obj["metadata"]["namespace"] = namespace
    return obj


def peers(c: RealCluster, path: str, namespace: str = "") -> dict:
    """The entries kopf keeps in the `corefleet-operator` peering object's status."""
    return (c.obj(path, namespace, "corefleet-operator") or {}).get("status") or {}


def test_cluster_wide_operator_joins_its_peering_and_reconciles(tmp_path):
    async def scenario():
        async with real_cluster(tmp_path, values=CLUSTER_WIDE_PEERED) as c:
            assert {d["kind"] for d in PEERING_CRDS} == {"CustomResourceDefinition"}
            await c.install_peering_crds()
            await c.request(
                "POST", f"{KOPF}/clusterkopfpeerings", peering_object("cluster-peering.yaml")
            )
            async with running_operator(
                namespaces=[],
                clusterwide=True,
                standalone=False,
                peering_name="corefleet-operator",
                priority=7,
            ):
                found = await eventually(lambda: peers(c, CLUSTER), what="operator in the peering")
                assert [p["priority"] for p in found.values()] == [7]
                await c.apply(engine_manifest(ranks=1))
                await eventually(lambda: 0 in c.pods(), what="rank created")
            await eventually(lambda: not peers(c, CLUSTER), what="operator left the peering")

    run(scenario())


@pytest.mark.parametrize("crds", [True, False], ids=["no-object", "no-crds"])
def test_namespaced_operator_without_its_peering_object_runs_standalone_and_says_so(tmp_path, crds):
    # Before: `corefleet-operator -n default` waited forever for a KopfPeering nobody created.
    async def scenario():
        async with real_cluster(tmp_path, values=NAMESPACED_PEERED) as c:
            if crds:
                await c.install_peering_crds()
            log_path = tmp_path / "operator.log"
            async with operator_process(c.kubeconfig, log_path, "-n", "default", stop="term") as (
                _,
                log,
            ):
                await c.apply(engine_manifest(ranks=2))
                await eventually(lambda: len(c.pods()) == 2, what="rank pods")
            (warning,) = lines_with(log, "running standalone")
            assert "WARNING" in warning
            assert "KopfPeering 'corefleet-operator' in namespace 'default'" in warning
            assert CREATE_IN_DEFAULT in warning
            if not crds:
                assert "kubectl apply -f crds/kopf-peering.yaml" in warning
            assert not c.objs(NAMESPACED, "default")  # nothing peered

    run(scenario())


@pytest.mark.parametrize("namespace", ["default", "def*"], ids=["missing-object", "pattern"])
def test_required_peering_without_its_object_exits_with_an_error(tmp_path, namespace):
    async def scenario():
        async with real_cluster(tmp_path, values=NAMESPACED_PEERED) as c:
            await c.install_peering_crds()
            await c.apply(engine_manifest(ranks=1))
            args = ("-n", namespace, "--require-peering")
            async with operator_process(c.kubeconfig, tmp_path / "op.log", *args) as (proc, log):
                await eventually(lambda: proc.poll() is not None, what="the operator's exit")
            assert proc.returncode != 0, log.text()
            errors = lines_with(log, "ERROR")
            assert errors, log.text()
            if namespace == "default":
                assert "KopfPeering 'corefleet-operator' in namespace 'default'" in errors[0]
                assert CREATE_IN_DEFAULT in errors[0]
            else:
                assert "namespace pattern 'def*'" in errors[0]
            assert not c.pods(), "a refused operator reconciled"

    run(scenario())


def test_namespaced_operator_with_its_peering_object_elects_a_leader(tmp_path):
    async def scenario():
        async with real_cluster(tmp_path, values=NAMESPACED_PEERED) as c:
            await c.install_peering_crds()
            await c.request(
                "POST",
                f"{KOPF}/namespaces/default/kopfpeerings",
                peering_object("namespaced-peering.yaml", "default"),
            )
            args = ("-n", "default", "--require-peering", "--priority", "5")
            log_path = tmp_path / "operator.log"
            async with operator_process(c.kubeconfig, log_path, *args, stop="term") as (_, log):
                found = await eventually(
                    lambda: peers(c, NAMESPACED, "default"), what="operator in the peering"
                )
                assert [p["priority"] for p in found.values()] == [5]
                await c.apply(engine_manifest(ranks=1))
                await eventually(lambda: 0 in c.pods(), what="rank created")
            assert lines_with(log, "running with leader election")
            assert not lines_with(log, "running standalone")

    run(scenario())
