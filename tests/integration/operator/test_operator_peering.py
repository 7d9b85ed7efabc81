"""Leader election through kopf peering: the CRDs in crds/, the objects in deploy/peering/, and
`corefleet-operator`'s start-up check, which never lets a missing peering object hang it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml
from operator_harness import (
    REPO,
    Cluster,
    cluster,
    engine_manifest,
    eventually,
    run,
    running_operator,
)

PEERING_CRDS = list(yaml.safe_load_all((REPO / "crds" / "kopf-peering.yaml").read_text()))
PEERING_OBJECTS = REPO / "deploy" / "peering"
CRD_URL = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
KOPF = "/apis/kopf.dev/v1"
NAMESPACED = "kopf.dev/v1/kopfpeerings"
CREATE_IN_DEFAULT = (
    'echo \'{"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name":'
    ' "corefleet-operator", "namespace": "default"}}\' | kubectl apply -f -'
)


async def install_peering_crds(c: Cluster) -> None:
    """POST kopf's CRDs, as `kubectl apply -f crds/` would, and wait until both are served."""
    for crd in PEERING_CRDS:
        await c.request("POST", CRD_URL, crd)
    deadline = time.monotonic() + 10
    while True:
        async with c.session.get(c.url + KOPF) as resp:
            listed = await resp.json(content_type=None) if resp.status == 200 else {}
        served = {r["name"] for r in listed.get("resources", [])}
        if {"kopfpeerings", "clusterkopfpeerings"} <= served:
            return
        assert time.monotonic() < deadline, f"kopf's CRDs never served: {served}"
        await asyncio.sleep(0.05)


def peering_object(kind_file: str, namespace: str | None = None) -> dict:
    """The object of a deploy/peering/ file, placed like `kubectl apply -n NAMESPACE` would."""
    obj = yaml.safe_load((PEERING_OBJECTS / kind_file).read_text())
    if namespace is not None:
        obj["metadata"]["namespace"] = namespace
    return obj


def operator_process(*args: str) -> subprocess.Popen[str]:
    """The real `corefleet-operator` command (KUBECONFIG from the harness), no liveness port."""
    command = [sys.executable, "-c", "from corefleet.operator.cli import cli; cli()"]
    return subprocess.Popen(
        [*command, *args, "--liveness", ""],
        env=dict(os.environ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


async def stop(proc: subprocess.Popen[str]) -> str:
    """SIGTERM the operator; it must exit cleanly within 30 s. Returns its log."""
    proc.send_signal(signal.SIGTERM)
    output, _ = await asyncio.to_thread(proc.communicate, timeout=30)
    assert proc.returncode == 0, output
    return output


def test_cluster_wide_operator_joins_its_peering_and_reconciles(tmp_path):
    async def scenario():
        async with cluster(tmp_path / "kubeconfig") as c:
            assert {d["kind"] for d in PEERING_CRDS} == {"CustomResourceDefinition"}
            await install_peering_crds(c)
            await c.request(
                "POST", f"{KOPF}/clusterkopfpeerings", peering_object("cluster-peering.yaml")
            )

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


@pytest.mark.parametrize("crds", [True, False], ids=["no-object", "no-crds"])
def test_namespaced_operator_without_its_peering_object_runs_standalone_and_says_so(tmp_path, crds):
    # Before: `corefleet-operator -n default` waited forever for a KopfPeering nobody created.
    async def scenario():
        async with cluster(tmp_path / "kubeconfig") as c:
            if crds:
                await install_peering_crds(c)
            proc = operator_process("-n", "default")
            try:
                await c.apply(engine_manifest(ranks=2))
                await eventually(lambda: len(c.pods()) == 2, timeout=30, what="rank pods")
            finally:
                output = await stop(proc)
            (warning,) = [line for line in output.splitlines() if "running standalone" in line]
            assert "WARNING" in warning
            assert "KopfPeering 'corefleet-operator' in namespace 'default'" in warning
            assert CREATE_IN_DEFAULT in warning
            if not crds:
                assert "kubectl apply -f crds/kopf-peering.yaml" in warning
            assert not c.emu.objs(NAMESPACED, "default")  # nothing peered

    run(scenario(), timeout=90)


@pytest.mark.parametrize("namespace", ["default", "def*"], ids=["missing-object", "pattern"])
def test_required_peering_without_its_object_exits_with_an_error(tmp_path, namespace):
    async def scenario():
        async with cluster(tmp_path / "kubeconfig") as c:
            await install_peering_crds(c)
            await c.apply(engine_manifest(ranks=1))
            proc = operator_process("-n", namespace, "--require-peering")
            output, _ = await asyncio.to_thread(proc.communicate, timeout=60)
            assert proc.returncode != 0, output
            errors = [line for line in output.splitlines() if "ERROR" in line]
            assert errors, output
            if namespace == "default":
                assert "KopfPeering 'corefleet-operator' in namespace 'default'" in errors[0]
                assert CREATE_IN_DEFAULT in errors[0]
            else:
                assert "namespace pattern 'def*'" in errors[0]
            assert not c.pods(), "a refused operator reconciled"

    run(scenario(), timeout=90)


def test_namespaced_operator_with_its_peering_object_elects_a_leader(tmp_path):
    async def scenario():
        async with cluster(tmp_path / "kubeconfig") as c:
            await install_peering_crds(c)
            await c.request(
                "POST",
                f"{KOPF}/namespaces/default/kopfpeerings",
                peering_object("namespaced-peering.yaml", "default"),
            )

            def peers():
                obj = c.emu.obj(NAMESPACED, "default", "corefleet-operator")
                return (obj or {}).get("status") or {}

            proc = operator_process("-n", "default", "--require-peering", "--priority", "5")
            try:
                found = await eventually(peers, timeout=30, what="operator listed in the peering")
                assert [p["priority"] for p in found.values()] == [5]
                await c.apply(engine_manifest(ranks=1))
                await eventually(lambda: 0 in c.pods(), timeout=30, what="rank created")
            finally:
                output = await stop(proc)
            assert "running with leader election" in output
            assert "running standalone" not in output

    run(scenario(), timeout=90)
