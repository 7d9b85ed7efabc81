"""A whole cluster on this machine: control plane, node, operator — entered as one context.

    with LocalCluster(tmp_path) as cluster:
        cluster.kubectl("apply", "-f", "examples/smollm2-cpu.yaml")
        ...

- the control plane: real etcd, kube-apiserver, kube-controller-manager and kube-scheduler on
  127.0.0.1 (`tests/controlplane/control_plane.py`), fresh for each cluster;
- the node: `Kubelet`, a registered Node whose pods (bound by the real scheduler) run in
  network namespaces, with Service DNS as /etc/hosts files: as processes of this machine's
  installation, or with `containers=True` from their images under runc (`runc_runtime.py`);
- the operator: installed with the real `helm install` of `charts/corefleet` (its CRD,
  ServiceAccount and ClusterRole; no replica), then run as the real `corefleet-operator`
  process out of cluster, authenticated as the chart's ServiceAccount with a token from the
  TokenRequest API, so every call it makes passes the chart's RBAC or fails the test. It runs
  in a private mount namespace whose /etc/hosts is the node's Service DNS, so it reaches the
  coordinator by its Service name as it would in a pod (`with_node_dns`, which runs any
  process, a test's client load say, with that view).

In the process mode, the image `ghcr.io/corefleet/corefleet:<tag>` and `corefleet:<tag>` mean
this machine's installation (the venv's `corefleet`) plus the file the Dockerfile adds, the
embedded SmolLM2 GGUF at /opt/corefleet/models/ (tests/deploy/test_dockerfile.py checks the
example uses that path). Exiting stops the operator, every container and namespace, and the
API server, also when the body raised.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import ssl
import subprocess
import sys
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

from container_runtime import Runtime
from container_spec import Image
from control_plane import ControlPlane
from e2e_support import CRD_FILE, wait_until
from kubelet import Kubelet, NodeIdentity
from node_object import NODE, NodeSize
from operator_identity import install_chart, operator_kubeconfig
from process_runtime import ProcessRuntime
from processes import free_port
from runc_runtime import RuncRuntime

from corefleet.engine.models.default_model import default_model_path

REPO = pathlib.Path(__file__).resolve().parents[2]
IMAGE_MODEL = "/opt/corefleet/models/SmolLM2-135M-Instruct.Q4_1.gguf"


def corefleet_image(pattern: str) -> Image:
    """This machine's corefleet installation as the image `pattern` names."""
    bin_dir = pathlib.Path(sys.executable).parent
    return Image(
        pattern=pattern,
        files={IMAGE_MODEL: pathlib.Path(default_model_path())},
        path=f"{bin_dir}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    )


def wait_for(check: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
    """`apiserver.wait_until` with the argument order these tests read best in."""
    return wait_until(check, timeout, interval, what)


DNS_USER = "corefleet:cluster-dns"
# What CoreDNS's ClusterRole grants, less what these hosts files do not use (pods, namespaces).
DNS_ROLE = {
    "apiVersion": "rbac.authorization.k8s.io/v1",
    "kind": "ClusterRole",
    "metadata": {"name": DNS_USER},
    "rules": [
        {"apiGroups": [""], "resources": ["services"], "verbs": ["list", "watch"]},
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["list", "watch"],
        },
    ],
}
DNS_BINDING = {
    "apiVersion": "rbac.authorization.k8s.io/v1",
    "kind": "ClusterRoleBinding",
    "metadata": {"name": DNS_USER},
    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": DNS_USER},
    "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": DNS_USER}],
}


def node_identity(api: ControlPlane) -> NodeIdentity:
    """The node's client and serving certificates, and cluster DNS's user with its RBAC."""
    user = f"system:node:{NODE}"
    client = api.pki.issue("kubelet-client", user, "system:nodes")
    names = ("127.0.0.1", NODE)
    serving = api.pki.issue("kubelet-serving", user, "system:nodes", server_names=names)
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(api.pki.ca))
    server_tls.load_cert_chain(str(serving.cert), str(serving.key))
    server_tls.verify_mode = ssl.CERT_REQUIRED
    rbac = "/apis/rbac.authorization.k8s.io/v1"
    api.request("POST", f"{rbac}/clusterroles", DNS_ROLE, expect=201)
    api.request("POST", f"{rbac}/clusterrolebindings", DNS_BINDING, expect=201)
    dns = api.pki.issue("cluster-dns", DNS_USER)
    return NodeIdentity(
        api.url, api.client_tls(client), server_tls, free_port(), api.client_tls(dns)
    )


# The node the examples are written for: a rank of examples/smollm2-cpu.yaml requests 4 cores
# and 6 GiB, as on a production node. This machine has 2 cores, so the local node declares the
# node it stands in for: the scheduler's arithmetic is real, the cores are shared.
EXAMPLE_NODE = NodeSize(cpus=16, memory="64Gi")


class LocalCluster:
    """Control plane + kubelet + operator; see the module docstring.

    `operator=False` leaves the operator out (a test of the node alone); `node` is what the
    node declares to the scheduler (`EXAMPLE_NODE` unless given; `node_object.this_machine()`
    for this machine's own figures), GPUs included (nothing runs them). `containers=True` runs
    the pods from their images (built by `make images`) under runc instead of as processes of
    this machine's installation (`runc_runtime.py`).
    """

    def __init__(
        self,
        folder: pathlib.Path,
        backoff_base: float = 2.0,
        operator_timer: float = 2.0,
        *,
        operator: bool = True,
        node: NodeSize = EXAMPLE_NODE,
        containers: bool = False,
    ) -> None:
        self.folder = folder
        # The CRD before the controller manager: its garbage collector knows the kind at once.
        self.api = ControlPlane(folder / "control-plane", crds=[CRD_FILE])
        self.kubelet: Kubelet | None = None
        self.operator: subprocess.Popen[bytes] | None = None
        self._backoff_base, self._timer = backoff_base, operator_timer
        self._with_operator, self._node = operator, node
        self._containers = containers
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> LocalCluster:
        try:
            self._stack.enter_context(self.api)
            self.kubelet = Kubelet(
                node_identity(self.api),
                self.folder / "node",
                self._runtime(),
                self._backoff_base,
                size=self._node,
            )
            self.kubelet.start()
            self._stack.callback(self.kubelet.stop)
            wait_for(self._node_schedulable, 120, "the node's not-ready taint to go", 0.2)
            if self._with_operator:
                install_chart(self.api)
                self.operator = self._start_operator()
                self._stack.callback(self._stop_operator)
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stack.close()

    def _runtime(self) -> Runtime:
        if self._containers:
            return RuncRuntime()
        images = [
            corefleet_image("ghcr.io/corefleet/corefleet:*"),
            corefleet_image("corefleet:*"),
        ]
        return ProcessRuntime(images)

    def _node_schedulable(self) -> bool:
        # A new Node gets the node.kubernetes.io/not-ready:NoSchedule taint (TaintNodesByCondition
        # admission) until the node lifecycle controller sees it Ready; a pod created before that
        # is refused for the taint, as on a cluster whose node has just joined.
        node = self.api.obj("v1/nodes", "", NODE) or {}
        taints = (node.get("spec") or {}).get("taints") or []
        return bool(node) and not any(
            t.get("key") == "node.kubernetes.io/not-ready" for t in taints
        )

    def kubectl(self, *args: str, check: bool = True, timeout: float = 30) -> str:
        """Run the real kubectl against this cluster; its standard output."""
        return self.api.kubectl(*args, check=check, timeout=timeout).stdout

    @property
    def operator_log(self) -> pathlib.Path:
        """Where the operator's output goes."""
        return self.folder / "operator.log"

    def with_node_dns(self, argv: Sequence[str]) -> list[str]:
        """`argv` run on the node with the cluster's Service DNS as its /etc/hosts.

        The node's own /etc/hosts knows no Service; the command gets a private mount namespace
        in which the kubelet's node hosts file is bind-mounted over it, so it resolves
        `<svc>.<ns>.svc.cluster.local` as a pod would, and sees the names change as pods come
        and go (the bind mount follows the file, which the kubelet rewrites in place). The
        command is exec'd: the process started is the command's, and signals reach it.
        """
        assert self.kubelet is not None
        script = 'mount --bind "$0" /etc/hosts && exec "$@"'
        unshare = ["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c", script]
        return [*unshare, str(self.kubelet.node_hosts), *argv]

    def _start_operator(self) -> subprocess.Popen[bytes]:
        assert self.kubelet is not None
        env = {
            **os.environ,
            "KUBECONFIG": str(
                operator_kubeconfig(self.api, self.folder / "operator.kubeconfig")[0]
            ),
            "COREFLEET_OPERATOR_TIMER_SECONDS": str(self._timer),
        }
        operator = str(pathlib.Path(sys.executable).parent / "corefleet-operator")
        # As the chart's Deployment runs it without watchNamespaces: every namespace, which is
        # what its ClusterRole allows (with `-n`, kopf would list namespaces, and be refused).
        argv = [operator, "--standalone", "--all-namespaces", "--liveness", ""]
        argv = self.with_node_dns(argv)
        with open(self.operator_log, "ab") as log:
            return subprocess.Popen(
                argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=self.folder
            )

    def _stop_operator(self) -> None:
        if self.operator is None or self.operator.poll() is not None:
            return
        self.operator.send_signal(signal.SIGTERM)
        try:
            self.operator.wait(20)
        except subprocess.TimeoutExpired:
            self.operator.kill()
            self.operator.wait(10)

    def logs(self) -> str:
        """The operator's and every pod's output, for a failure message."""
        operator = (
            self.operator_log.read_text(errors="replace") if self.operator_log.exists() else ""
        )
        parts = [f"--- operator\n{operator[-4000:]}"]
        logs = self.folder / "node" / "logs"
        for path in sorted(logs.glob("*.log")) if logs.exists() else []:
            parts.append(f"--- {path.stem}\n{path.read_text(errors='replace')[-3000:]}")
        return "\n".join(parts)
