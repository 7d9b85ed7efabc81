"""The operator's identity as the chart installs it, on a real control plane.

`install_chart(api, values)` renders `charts/corefleet` with the real `helm template` (once per
set of `--set` values in a session) and creates its objects but the operator Deployment and the
kopf peering objects (the tests run the operator themselves and create the peering objects they
need): the InferenceEngine CRD (waited on until Established), the ServiceAccount, the
ClusterRole(s), Role(s) and bindings. `operator_kubeconfig` writes a kubeconfig whose user is that
ServiceAccount, with a token from the TokenRequest API (what the kubelet mounts into the operator
pod), so an operator using it has exactly the chart's RBAC: a rule the chart lacks is a 403.

Which values: `NAMESPACED` (`watchNamespaces={default}`: a Role in `default`) for an operator
run with `-n default`, `CLUSTER_WIDE` (the default values: a ClusterRole) for `-A`; the `PEERED`
variants add the peering rules (`replicaCount=2`) for an operator that looks up or joins a kopf
peering. Each token names its ServiceAccount and carries its own `jti`, which the audit log
records (`user.extra["authentication.kubernetes.io/credential-id"]`): `credential_id(token)` tells
two operator processes of the same ServiceAccount apart.
"""

from __future__ import annotations

import base64
import functools
import json
import pathlib
import subprocess
import sys
from typing import Any

import yaml
from control_plane import ControlPlane

REPO = pathlib.Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "corefleet"
RELEASE, NAMESPACE = "corefleet", "corefleet-system"
SERVICE_ACCOUNT = "corefleet"  # the chart's fullname for release "corefleet"
OPERATOR_USER = f"system:serviceaccount:{NAMESPACE}:{SERVICE_ACCOUNT}"
CRD_NAME = "inferenceengines.corefleet.dev"
NAMESPACED = ("watchNamespaces={default}",)
CLUSTER_WIDE: tuple[str, ...] = ()
NAMESPACED_PEERED = (*NAMESPACED, "replicaCount=2")
CLUSTER_WIDE_PEERED = ("replicaCount=2",)
LEFT_OUT = {"Deployment", "KopfPeering", "ClusterKopfPeering"}
COLLECTIONS = {  # kind -> (collection URL, namespaced)
    "ServiceAccount": ("/api/v1/namespaces/{ns}/serviceaccounts", True),
    "CustomResourceDefinition": ("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", False),
    "ClusterRole": ("/apis/rbac.authorization.k8s.io/v1/clusterroles", False),
    "ClusterRoleBinding": ("/apis/rbac.authorization.k8s.io/v1/clusterrolebindings", False),
    "Role": ("/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles", True),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings", True),
}


def helm() -> str:
    """The helm binary the test extra installs next to this interpreter."""
    return str(pathlib.Path(sys.executable).parent / "helm")


@functools.cache
def rendered_chart(values: tuple[str, ...] = CLUSTER_WIDE) -> tuple[dict[str, Any], ...]:
    """The chart's objects as `helm template` renders them with these `--set` values."""
    argv = [helm(), "template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    for value in values:
        argv += ["--set", value]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True)
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)


def install_chart(api: ControlPlane, values: tuple[str, ...] = CLUSTER_WIDE) -> None:
    """Create the chart's objects (see the module docstring) and wait for the CRD to be served."""
    api.request("POST", "/api/v1/namespaces", {"metadata": {"name": NAMESPACE}}, expect=(201, 409))
    for doc in rendered_chart(values):
        if doc["kind"] in LEFT_OUT:
            continue
        url, namespaced = COLLECTIONS[doc["kind"]]
        namespace = doc["metadata"].get("namespace") or NAMESPACE
        collection = url.format(ns=namespace) if namespaced else url
        if doc["kind"] == "CustomResourceDefinition":
            _create_or_find_crd(api, collection, doc)
        else:
            api.request("POST", collection, doc, expect=201)
    api.wait_established(CRD_NAME)


def _create_or_find_crd(api: ControlPlane, collection: str, crd: dict[str, Any]) -> None:
    # A control plane started with `crds=` has it already (installed before the controller
    # manager); it must be the chart's own, not another version of it.
    status, _ = api.request("POST", collection, crd, expect=(201, 409))
    if status == 409:
        found = api.get(f"{collection}/{crd['metadata']['name']}") or {}
        assert found.get("spec", {}).get("versions") == crd["spec"]["versions"], (
            "the CRD installed earlier is not the chart's"
        )


def service_account_token(api: ControlPlane, namespace: str, name: str) -> str:
    """A fresh token for a ServiceAccount, from the TokenRequest API."""
    body = {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenRequest",
        "spec": {"expirationSeconds": 24 * 3600},
    }
    path = f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token"
    _, answer = api.request("POST", path, body, expect=201)
    return str(answer["status"]["token"])


def credential_id(token: str) -> str:
    """How the audit log names the credential of a service-account token: `JTI=<its jti>`."""
    payload = token.split(".")[1]
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    return f"JTI={claims['jti']}"


def operator_kubeconfig(api: ControlPlane, path: pathlib.Path) -> tuple[pathlib.Path, str]:
    """A kubeconfig for the chart's ServiceAccount (a fresh token), written to `path`; and the
    token's `credential_id`."""
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
    return path, credential_id(token)
