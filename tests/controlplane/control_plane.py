"""A real Kubernetes control plane on loopback: etcd, kube-apiserver, controller manager, scheduler.

The binaries are the ones `make cluster-bin` builds (tools/controlplane/build.sh): the release
that tools/controlplane/go.mod pins, and the etcd it pins. `binaries()` finds them (the folder
COREFLEET_CONTROLPLANE_BIN names, or the build script's cache folder for the current go.mod,
go.sum and script) or says why it cannot.

    with ControlPlane(tmp_path / "cluster") as cp:
        cp.kubectl("apply", "-f", "crds/")
        status, body = cp.request("GET", "/api/v1/namespaces/default/pods")

Everything runs as on a kubeadm cluster, minus the parts no test here reaches: TLS everywhere
(one CA, `pki.py`), RBAC and the Node authorizer, the default admission plugins plus
NodeRestriction, service-account tokens signed by the API server, the controller manager with
one service account per controller. Differences, each for a reason:
- etcd keeps its data under /dev/shm when it can (fsync on a loaded CI disk is what makes a
  cold API server slow; nothing here must survive the test);
- the `kubernetes` Service has no endpoints (`--endpoint-reconciler-type=none`): its address
  would be 127.0.0.1, which an Endpoints object may not hold, and no pod here dials it;
- the HPA controller syncs every 2 s rather than 15 s, so a test sees it act in seconds.
`start_timeout` bounds each wait; every process is stopped on exit, also after a failure.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import ssl
import subprocess
import tempfile
from collections.abc import Sequence
from typing import Any

import yaml
from admin_client import AdminClient
from pki import Credential, Pki
from processes import Component, free_port, poll

REPO = pathlib.Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "tools" / "controlplane" / "build.sh"
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
SERVICE_CIDR = "10.96.0.0/16"
ETCD_DATA_PREFIX = "corefleet-etcd-"  # + the test process's pid: see _remove_orphaned_data


def binaries() -> pathlib.Path | str:
    """The folder of the control-plane binaries, or the reason there is none."""
    env = os.environ.get("COREFLEET_CONTROLPLANE_BIN")
    cache = pathlib.Path(
        os.environ.get("COREFLEET_CACHE", pathlib.Path.home() / ".cache" / "corefleet")
    )
    release = _pinned_release()
    folder = pathlib.Path(env) if env else cache / "controlplane" / f"kubernetes-{release}-{_key()}"
    if all(os.access(folder / name, os.X_OK) for name in BINARIES):
        return folder
    return (
        f"no Kubernetes {release} control plane built at {folder}: run `make cluster-bin` "
        f"({BUILD_SCRIPT.relative_to(REPO)}), or set COREFLEET_CONTROLPLANE_BIN"
    )


def _key() -> str:
    """The build's cache key, as build.sh computes it (POSIX cksum of go.mod, go.sum, itself)."""
    files = [BUILD_SCRIPT.parent / "go.mod", BUILD_SCRIPT.parent / "go.sum", BUILD_SCRIPT]
    data = b"".join(f.read_bytes() for f in files)
    done = subprocess.run(["cksum"], input=data, capture_output=True, check=True, timeout=30)
    return done.stdout.split()[0].decode()


def _pinned_release() -> str:
    for line in (BUILD_SCRIPT.parent / "go.mod").read_text().splitlines():
        words = line.split()
        if len(words) >= 2 and words[0] == "k8s.io/kubernetes":
            return words[1]
    raise RuntimeError("tools/controlplane/go.mod pins no k8s.io/kubernetes")


def _remove_orphaned_data(root: pathlib.Path) -> None:
    """Remove etcd data folders whose test process is gone (a run killed outright)."""
    for folder in root.glob(f"{ETCD_DATA_PREFIX}*-*"):
        pid = folder.name[len(ETCD_DATA_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not pathlib.Path(f"/proc/{pid}").exists():
            shutil.rmtree(folder, ignore_errors=True)


def kubeconfig(server: str, ca: pathlib.Path, user: Credential, name: str) -> dict[str, Any]:
    """A kubeconfig for one user of this cluster (client certificate authentication)."""
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": name,
        "clusters": [
            {"name": "local", "cluster": {"server": server, "certificate-authority": str(ca)}}
        ],
        "users": [
            {
                "name": name,
                "user": {"client-certificate": str(user.cert), "client-key": str(user.key)},
            }
        ],
        "contexts": [
            {
                "name": name,
                "context": {"cluster": "local", "user": name, "namespace": "default"},
            }
        ],
    }


class ControlPlane(AdminClient):
    """etcd + kube-apiserver (+ controller manager, + scheduler); a context manager.

    Attributes, valid inside the `with` block: `url` ("https://127.0.0.1:PORT"), `kubeconfig`
    (the admin's, `system:masters`), `pki` (the CA and `issue()` for more users), `folder`.
    `crds`: CRD files applied and Established before the controller manager starts, as on a
    cluster where they were installed earlier.
    """

    def __init__(
        self,
        folder: pathlib.Path,
        *,
        controller_manager: bool = True,
        scheduler: bool = True,
        start_timeout: float = 120.0,
        extra_apiserver_flags: Sequence[str] = (),
        crds: Sequence[pathlib.Path] = (),
    ) -> None:
        found = binaries()
        if isinstance(found, str):
            raise RuntimeError(found)
        self.bin, self.folder = found, folder
        self.kubeconfig = folder / "admin.kubeconfig"
        self.url = ""
        self._with_kcm, self._with_scheduler = controller_manager, scheduler
        self._timeout = start_timeout
        self._extra = list(extra_apiserver_flags)
        self._crds = list(crds)
        self._components: list[Component] = []
        self._stack = contextlib.ExitStack()

    # --- lifecycle
    def __enter__(self) -> ControlPlane:
        self.folder.mkdir(parents=True, exist_ok=True)
        try:
            self.pki = Pki(self.folder / "pki")
            self._start_etcd()
            self._start_apiserver()
            for path in self._crds:
                # Before the controller manager: its garbage collector learns the resources
                # it follows owner references to at start, then only every 30 s, so a kind
                # installed later leaves its children's collection waiting for that.
                self.apply_crds(path, timeout=self._timeout)
            if self._with_kcm:
                self.start_controller_manager()
            if self._with_scheduler:
                config = self._user_kubeconfig("scheduler", "system:kube-scheduler")
                self._start(
                    "kube-scheduler",
                    [
                        f"--kubeconfig={config}",
                        "--leader-elect=false",
                        "--secure-port=0",
                    ],
                )
            if self._with_kcm:
                # ServiceAccount admission refuses pods until the namespace's `default`
                # account exists; the controller manager creates it.
                poll(
                    lambda: self.get("/api/v1/namespaces/default/serviceaccounts/default"),
                    self._timeout,
                    "the default service account",
                    self._components,
                )
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop every component, newest first, and remove etcd's data."""
        for component in reversed(self._components):
            component.stop()
        self._stack.close()

    def logs(self, chars: int = 3000) -> str:
        """The end of every component's log, for a failure message."""
        return "\n".join(f"--- {c.name}\n{c.tail(chars)}" for c in self._components)

    # --- the components
    def _start(self, name: str, args: Sequence[str]) -> Component:
        component = Component(name, [str(self.bin / name), *args], self.folder)
        component.start()
        self._components.append(component)
        return component

    def _start_etcd(self) -> None:
        shm = pathlib.Path("/dev/shm")
        root = shm if shm.is_dir() else self.folder
        _remove_orphaned_data(root)
        data = pathlib.Path(tempfile.mkdtemp(prefix=f"{ETCD_DATA_PREFIX}{os.getpid()}-", dir=root))
        self._stack.callback(shutil.rmtree, data, True)
        client, peer = free_port(), free_port()
        self.etcd_url = f"http://127.0.0.1:{client}"
        self._start(
            "etcd",
            [
                "--name=local",
                f"--data-dir={data}",
                f"--listen-client-urls={self.etcd_url}",
                f"--advertise-client-urls={self.etcd_url}",
                f"--listen-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-cluster=local=http://127.0.0.1:{peer}",
                "--listen-metrics-urls=",
                "--log-level=warn",
            ],
        )

    def _start_apiserver(self) -> None:
        port = free_port()
        self.url = f"https://127.0.0.1:{port}"
        serving = self.pki.issue(
            "apiserver",
            "kube-apiserver",
            server_names=(
                "127.0.0.1",
                "localhost",
                "10.96.0.1",
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
            ),
        )
        kubelet_client = self.pki.issue(
            "apiserver-kubelet-client", "kube-apiserver-kubelet-client", "kubeadm:cluster-admins"
        )
        admin = self.pki.issue("admin", "kubernetes-admin", "system:masters")
        self.admin = admin
        self.kubeconfig.write_text(
            yaml.safe_dump(kubeconfig(self.url, self.pki.ca, admin, "admin"))
        )
        self.tls = self.client_tls(admin)
        pki = self.pki
        apiserver = self._start(
            "kube-apiserver",
            [
                f"--etcd-servers={self.etcd_url}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={port}",
                f"--tls-cert-file={serving.cert}",
                f"--tls-private-key-file={serving.key}",
                f"--client-ca-file={pki.ca}",
                f"--kubelet-client-certificate={kubelet_client.cert}",
                f"--kubelet-client-key={kubelet_client.key}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={pki.service_account_pub}",
                f"--service-account-signing-key-file={pki.service_account_key}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=NodeRestriction",
                "--endpoint-reconciler-type=none",
                "--kubelet-preferred-address-types=InternalIP",
                f"--kubelet-certificate-authority={pki.ca}",
                "--profiling=false",
                *self._extra,
            ],
        )
        poll(
            lambda: self._readyz(),
            self._timeout,
            "kube-apiserver's /readyz",
            [*self._components, apiserver],
        )

    def _readyz(self) -> bool:
        with contextlib.suppress(OSError):
            status, _ = self.request("GET", "/readyz", timeout=5)
            return status == 200
        return False

    def start_controller_manager(self) -> None:
        """Start kube-controller-manager (done on entry unless `controller_manager=False`; later,
        after a CRD is installed, its garbage collector knows the kind at once)."""
        config = self._user_kubeconfig("controller-manager", "system:kube-controller-manager")
        self._start(
            "kube-controller-manager",
            [
                f"--kubeconfig={config}",
                "--leader-elect=false",
                "--secure-port=0",
                "--use-service-account-credentials=true",
                f"--service-account-private-key-file={self.pki.service_account_key}",
                f"--root-ca-file={self.pki.ca}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--horizontal-pod-autoscaler-sync-period=2s",
            ],
        )

    def _user_kubeconfig(self, stem: str, user: str, group: str | None = None) -> pathlib.Path:
        credential = self.pki.issue(stem, user, group)
        path = self.folder / f"{stem}.kubeconfig"
        path.write_text(yaml.safe_dump(kubeconfig(self.url, self.pki.ca, credential, stem)))
        return path

    def client_tls(self, user: Credential) -> ssl.SSLContext:
        """A TLS context that trusts this cluster's CA and presents `user`'s certificate."""
        context = ssl.create_default_context(cafile=str(self.pki.ca))
        context.load_cert_chain(str(user.cert), str(user.key))
        return context

    def user_kubeconfig(self, stem: str, user: str, group: str | None = None) -> pathlib.Path:
        """A kubeconfig for another user of this cluster (a node, say: `system:node:NAME` in
        `system:nodes`)."""
        return self._user_kubeconfig(stem, user, group)
