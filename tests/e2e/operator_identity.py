"""The operator run as the chart runs it: its ServiceAccount's token, its Deployment's command.

The chart's objects and the token come from `chart_install` (tests/controlplane): the CRD, the
ServiceAccount, the ClusterRole and its binding, without the Deployment (the local node has no
operator image; the test runs the operator itself), and a kubeconfig whose user is that
ServiceAccount, so the operator process has exactly the chart's RBAC: a rule the chart lacks is
a 403 in the test. `operator` runs it that way, with the command line `deployment_argv` reads
from an installed release's Deployment.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence

from chart_install import CHART, helm, install_chart, operator_kubeconfig
from control_plane import ControlPlane

__all__ = ["CHART", "deployment_argv", "helm", "install_chart", "operator", "operator_kubeconfig"]


def deployment_argv(api: ControlPlane, namespace: str, name: str) -> list[str]:
    """The operator Deployment's command and args, with the liveness endpoint off (several
    replicas on one machine would share its port)."""
    deployment = api.obj("apps/v1/deployments", namespace, name)
    assert deployment is not None, f"no Deployment {namespace}/{name}"
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    args = [a for a in container["args"] if not a.startswith("--liveness")]
    binary = str(pathlib.Path(sys.executable).parent / container["command"][0])
    return [binary, *args, "--liveness="]


@contextlib.contextmanager
def operator(
    api: ControlPlane, argv: Sequence[str], log: pathlib.Path, pod_id: str
) -> Iterator[subprocess.Popen[bytes]]:
    """The operator as the chart's ServiceAccount (a token from the TokenRequest API); POD_ID
    is kopf's peering identity, as a pod's name would be."""
    config, _ = operator_kubeconfig(api, log.with_suffix(".kubeconfig"))
    env = {**os.environ, "KUBECONFIG": str(config), "POD_ID": pod_id}
    env["COREFLEET_OPERATOR_ADMIN_PROBE"] = "0"  # no coordinator runs: nothing to probe
    with open(log, "ab") as out:
        process = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
