"""A real control plane as a scenario's API server, the operator logged in as the chart's account.

`real_cluster(folder, ...)` starts `ControlPlane` (tests/controlplane: etcd and kube-apiserver
v1.36 with TLS, RBAC and the default admission plugins; the controller manager and the scheduler
only when asked), with an audit log (`audit_log.py`), installs the chart's CRD, ServiceAccount
and RBAC (`chart_install.py`, with `values`: NAMESPACED for `-n default`, ...), and points
KUBECONFIG at a token of that ServiceAccount, so the operator (`operator_run.py`) has exactly the
chart's rights: a request the chart does not allow is a 403, and the scenario fails. The test
itself acts as the cluster's admin.

What runs besides the API server, per scenario:
- `controller_manager=False` (default): no controller; the test plays the Deployment controller
  (`coordinator_available` writes the Deployment's status), and the namespace's `default`
  ServiceAccount, which pod admission needs, is created here. With it, the real Deployment,
  ReplicaSet, garbage-collector and HPA controllers run; `coordinator_available` then plays the
  kubelet of the coordinator pods the real ReplicaSet made (Ready), and the real controllers
  report the Deployment available.
- `scheduler=False` (default): pods stay unscheduled, unless `pod_termination_seconds` is given:
  then `StandInKubelet` binds them to a Node object and finishes their graceful deletion after
  that many seconds (an unscheduled pod is deleted at once). The test plays the kubelet's status.
The operator's requests are in `audit` (`writes()` counts them by object name). A scenario that
ends with any request of the operator's ServiceAccount refused (403) fails: the chart's RBAC
lacks a rule, even where the operator got by without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
import yaml
from audit_log import AuditLog, Entry, audit_flags, by_user, forbidden, in_group
from chart_install import (
    NAMESPACED,
    OPERATOR_USER,
    helm,
    install_chart,
    operator_kubeconfig,
)
from control_plane import ControlPlane, binaries
from operator_harness import REPO, Cluster, eventually, running_status
from processes import poll
from stand_in_kubelet import StandInKubelet

PEERING_CRDS = [
    doc
    for doc in yaml.safe_load_all((REPO / "crds" / "kopf-peering.yaml").read_text())
    if doc and doc["kind"] == "CustomResourceDefinition"
]
CRD_URL = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
DEFAULT_SA = "/api/v1/namespaces/default/serviceaccounts"
COORDINATORS = "corefleet.dev/engine={},app.kubernetes.io/component=coordinator"


class RealCluster(Cluster):
    """A running control plane (`api`, its admin client), its audit log, and HTTP helpers."""

    def __init__(
        self,
        api: ControlPlane,
        session: aiohttp.ClientSession,
        folder: pathlib.Path,
        controller_manager: bool,
    ) -> None:
        self.api, self.url, self.session, self.folder = api, api.url, session, folder
        self.controller_manager = controller_manager
        self.audit = AuditLog(folder / "audit" / "audit.log")
        self.kubelet: StandInKubelet | None = None
        self.kubeconfig = folder / "operator.kubeconfig"
        self.credential = ""  # the audit log's name for the token in `kubeconfig`

    def obj(self, path: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.api.obj(path, namespace, name)

    def objs(self, path: str, namespace: str | None = None, selector: str = "") -> list[Any]:
        return self.api.objs(path, namespace, selector)

    def operator_kubeconfig(self, name: str) -> tuple[pathlib.Path, str]:
        """Another kubeconfig of the chart's ServiceAccount, with a token of its own (for a
        second operator process), and the token's credential id (`audit_log.by_credential`)."""
        return operator_kubeconfig(self.api, self.folder / f"{name}.kubeconfig")

    def writes(
        self, verb: str, resource: str = "pods", user: Callable[[Entry], bool] | None = None
    ) -> dict[str, int]:
        """How often the operator (or `user`) sent `verb` for each object of `resource`."""
        return dict(self.audit.names(verb, resource, user or by_user(OPERATOR_USER)))

    async def coordinator_available(self, name: str = "llama", available: bool = True) -> None:
        """Without the controller manager, play the Deployment controller (its status); with
        it, play the kubelet of the coordinator pods the real ReplicaSet made."""
        if not self.controller_manager:
            await super().coordinator_available(name, available)
            return
        pods = await eventually(
            lambda: self.objs("v1/pods", "default", COORDINATORS.format(name)),
            what="coordinator pods of the real ReplicaSet",
        )
        for pod in pods:
            await self.set_pod(pod["metadata"]["name"], running_status(available, "coordinator"))

    async def install_peering_crds(self) -> None:
        """kopf's peering CRDs (crds/kopf-peering.yaml), created and Established."""
        for crd in PEERING_CRDS:
            await self.request("POST", CRD_URL, crd)
        for crd in PEERING_CRDS:
            await asyncio.to_thread(self.api.wait_established, crd["metadata"]["name"])


def _start_controller_manager(api: ControlPlane) -> None:
    # ControlPlane starts it only in __enter__; this is the same, later (it creates the
    # namespace's `default` ServiceAccount, which pod admission needs).
    api.start_controller_manager()
    poll(lambda: api.get(f"{DEFAULT_SA}/default"), 120, "the default ServiceAccount")


def _skip_or_fail(reason: str) -> None:
    if os.environ.get("COREFLEET_REQUIRE_CONTROLPLANE") == "1":
        pytest.fail(f"COREFLEET_REQUIRE_CONTROLPLANE=1, but {reason}")
    pytest.skip(reason)


def why_not() -> str | None:
    """Why no real control plane can run here (None: it can)."""
    found = binaries()
    if isinstance(found, str):
        return found
    if not os.access(helm(), os.X_OK):
        return f"helm is not installed at {helm()} (the test extra installs it)"
    return None


@contextlib.asynccontextmanager
async def real_cluster(
    folder: pathlib.Path,
    *,
    values: tuple[str, ...] = NAMESPACED,
    controller_manager: bool = False,
    scheduler: bool = False,
    pod_termination_seconds: float | None = None,
) -> AsyncIterator[RealCluster]:
    """A control plane with the chart installed; KUBECONFIG is the operator's meanwhile."""
    reason = why_not()
    if reason is not None:
        _skip_or_fail(reason)
    flags = audit_flags(folder / "audit")
    # The controller manager starts once the CRD is served, as on a cluster where the chart
    # was installed before: its garbage collector and disruption controller discover the
    # resources they follow owner references to every 30 s, and would act late otherwise.
    plane = ControlPlane(
        folder / "control-plane",
        controller_manager=False,
        scheduler=scheduler,
        extra_apiserver_flags=flags,
    )
    saved = os.environ.get("KUBECONFIG")
    with plane as api:
        try:
            await asyncio.to_thread(install_chart, api, values)
            if controller_manager:
                await asyncio.to_thread(_start_controller_manager, api)
            else:  # the ServiceAccount controller's work: pod admission needs the account
                api.request("POST", DEFAULT_SA, {"metadata": {"name": "default"}}, expect=201)
            connector = aiohttp.TCPConnector(ssl=api.tls)
            async with aiohttp.ClientSession(connector=connector) as session:
                cluster = RealCluster(api, session, folder, controller_manager)
                _, cluster.credential = operator_kubeconfig(api, cluster.kubeconfig)
                os.environ["KUBECONFIG"] = str(cluster.kubeconfig)
                async with _kubelet(cluster, pod_termination_seconds):
                    yield cluster
                refused = forbidden(cluster.audit.select(user=in_group()))
                assert not refused, f"the chart's RBAC refused the operator: {refused}"
        except BaseException:
            print(api.logs(2000))  # shown with the failure
            raise
        finally:
            if saved is None:
                os.environ.pop("KUBECONFIG", None)
            else:
                os.environ["KUBECONFIG"] = saved


@contextlib.asynccontextmanager
async def _kubelet(cluster: RealCluster, seconds: float | None) -> AsyncIterator[None]:
    if seconds is None:
        yield
        return
    cluster.kubelet = StandInKubelet(cluster.url, cluster.session, seconds)
    task = asyncio.create_task(cluster.kubelet.run())
    try:
        yield
    finally:
        if task.done():
            task.result()  # the stand-in failed: say why
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
