"""The operator as the chart installs it: the chart's objects, its ServiceAccount and a token.

`install_chart` renders `charts/corefleet` with the real `helm template` and applies it with
the real kubectl: the InferenceEngine CRD (waited on until Established), the namespace's
ServiceAccount, the ClusterRole and its binding. The operator Deployment is left out: the local
node has no operator image, and the test runs the operator itself. `operator_kubeconfig` writes
a kubeconfig whose user is that ServiceAccount, with a token from the TokenRequest API (as the
kubelet mounts into the operator's pod), so the operator process has exactly the chart's RBAC:
a rule the chart lacks is a 403 in the test. `operator` runs the operator that way, with the
command line `deployment_argv` reads from an installed release's Deployment.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import yaml
from control_plane import ControlPlane

REPO = pathlib.Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "corefleet"
RELEASE, NAMESPACE = "corefleet", "corefleet-system"
SERVICE_ACCOUNT = "corefleet"  # the chart's fullname for release "corefleet"
TOKEN_SECONDS = 24 * 3600


def helm() -> str:
    """The helm binary the test extra installs next to this interpreter."""
    return str(pathlib.Path(sys.executable).parent / "helm")


def rendered_chart(*values: str) -> list[dict[str, Any]]:
    """The chart's objects as `helm template` renders them (`values`: --set arguments)."""
    argv = [helm(), "template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    for value in values:
        argv += ["--set", value]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True)
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def install_chart(api: ControlPlane) -> None:
    """Apply the chart's objects but its Deployment, and wait for the CRD to be served."""
    api.request("POST", "/api/v1/namespaces", {"metadata": {"name": NAMESPACE}}, expect=(201, 409))
    docs = [doc for doc in rendered_chart() if doc.get("kind") != "Deployment"]
    api.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs), timeout=60)
    api.wait_established("inferenceengines.corefleet.dev")


def service_account_token(api: ControlPlane, namespace: str, name: str) -> str:
    """A token for a ServiceAccount, from the TokenRequest API."""
    body = {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenRequest",
        "spec": {"expirationSeconds": TOKEN_SECONDS},
    }
    path = f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token"
    _, answer = api.request("POST", path, body, expect=201)
    return str(answer["status"]["token"])


def operator_kubeconfig(api: ControlPlane, path: pathlib.Path) -> pathlib.Path:
    """A kubeconfig for the chart's ServiceAccount; written to `path`, which is returned."""
    token = service_account_token(api, NAMESPACE, SERVICE_ACCOUNT)
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "operator",
        "clusters": [
            {
                "name": "local",
                "cluster": {"server": api.url, "certificate-authority": str(api.pki.ca)},
            }
        ],
        "users": [{"name": "operator", "user": {"token": token}}],
        "contexts": [
            {
                "name": "operator",
                "context": {"cluster": "local", "user": "operator", "namespace": "default"},
            }
        ],
    }
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


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
    config = operator_kubeconfig(api, log.with_suffix(".kubeconfig"))
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
