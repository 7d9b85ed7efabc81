"""A whole cluster on this machine: API server, node, operator — entered as one context.

    with LocalCluster(tmp_path) as cluster:
        cluster.kubectl("apply", "-f", "examples/smollm2-cpu.yaml")
        ...

- the API server: the kmock-based emulator on 127.0.0.1 with a kubeconfig (`apiserver.py`);
- the node: `Kubelet` (pods as processes in network namespaces, Deployments, Service DNS);
- the operator: the real `corefleet-operator` process, run out of cluster with the kubeconfig
  (as `kopf run` is during development), in a private mount namespace whose /etc/hosts is the
  node's Service DNS, so it reaches the coordinator by its Service name as it would in a pod
  (`with_node_dns`, which runs any process, a test's client load say, with that view).

The image: `ghcr.io/corefleet/corefleet:<tag>` and `corefleet:<tag>` mean this machine's
installation (the venv's `corefleet`) plus the file the Dockerfile adds, the embedded SmolLM2
GGUF at /opt/corefleet/models/ (tests/deploy/test_dockerfile.py checks the example uses that
path). Exiting stops the operator, every container and namespace, and the API server, also when
the body raised.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

from apiserver import ApiServer, wait_until
from container_spec import Image
from kubelet import Kubelet

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


class LocalCluster:
    """API server + kubelet + operator; see the module docstring."""

    def __init__(
        self, folder: pathlib.Path, backoff_base: float = 2.0, operator_timer: float = 2.0
    ) -> None:
        self.folder = folder
        self.api = ApiServer(folder)
        self.kubelet: Kubelet | None = None
        self.operator: subprocess.Popen[bytes] | None = None
        self._backoff_base, self._timer = backoff_base, operator_timer
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> LocalCluster:
        try:
            self._stack.enter_context(self.api)
            images = [
                corefleet_image("ghcr.io/corefleet/corefleet:*"),
                corefleet_image("corefleet:*"),
            ]
            self.kubelet = Kubelet(self.api.url, self.folder / "node", images, self._backoff_base)
            self.kubelet.start()
            self._stack.callback(self.kubelet.stop)
            kubelet = self.kubelet
            self.api.emu.pod_logs = lambda ns, pod, _container: kubelet.log(ns, pod) or None
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
            "KUBECONFIG": str(self.api.kubeconfig),
            "COREFLEET_OPERATOR_TIMER_SECONDS": str(self._timer),
        }
        operator = str(pathlib.Path(sys.executable).parent / "corefleet-operator")
        argv = self.with_node_dns([operator, "--standalone", "-n", "default", "--liveness", ""])
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
        parts = [f"--- operator\n{self.operator_log.read_text(errors='replace')[-4000:]}"]
        logs = self.folder / "node" / "logs"
        for path in sorted(logs.glob("*.log")) if logs.exists() else []:
            parts.append(f"--- {path.stem}\n{path.read_text(errors='replace')[-3000:]}")
        return "\n".join(parts)
