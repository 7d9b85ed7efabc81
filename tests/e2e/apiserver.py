"""The end-to-end harness's API server: KubeEmu on loopback, a kubeconfig, and the real kubectl.

`ApiServer` serves a `KubeEmu` (tests/integration/operator/kubeemu.py) from its own thread and
event loop on a free 127.0.0.1 port, the way a cluster's kube-apiserver is a separate process:
the operator, the local kubelet, kubectl and the test all talk to it over HTTP only. On entry it
creates the namespaces (`default`) and POSTs the CRDs (the InferenceEngine CRD), both through
the API as `kubectl apply` would, and writes a kubeconfig for them. Pod deletion is the real
kubelet's protocol (`KubeEmu(kubelet_finalizes_pods=True)`): a DELETE of a scheduled pod only
marks it terminating, and the kubelet's final `gracePeriodSeconds=0` DELETE removes it.

    with ApiServer(tmp_path / "api") as api:
        api.kubectl("apply", "-f", "examples/smollm2-cpu.yaml")   # --validate=false is added
        print(api.kubectl("get", "ie").stdout)
        status, body = api.request("GET", "/api/v1/namespaces/default/pods")

What kubectl can and cannot do against the emulator is listed in kubeemu.py's docstring; the
one surprise is that `kubectl create <generator>` (`create namespace`, `create configmap`, ...)
sends protobuf, which the emulator refuses with 415: write a manifest and `apply -f` it.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import yaml
from kubeemu import KubeEmu
from kubeemu_server import ServedInThread

REPO = pathlib.Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "crds" / "inferenceengines.corefleet.dev.yaml"
KUBECTL: str | None = shutil.which("kubectl")
VALIDATING_VERBS = {"apply", "create", "replace"}  # verbs that take --validate
JSON = "application/json"
MERGE = "application/merge-patch+json"
T = TypeVar("T")


class KubectlError(subprocess.CalledProcessError):
    """kubectl exited non-zero; the message carries its stderr and stdout."""

    def __str__(self) -> str:
        return (
            f"{' '.join(map(str, self.cmd))} exited {self.returncode}\n"
            f"stderr: {self.stderr}\nstdout: {self.stdout}"
        )


def wait_until(
    check: Callable[[], T | None], timeout: float = 10.0, interval: float = 0.05, what: str = ""
) -> T:
    """Poll `check` until it returns something truthy (returned); AssertionError after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or check}")
        time.sleep(interval)


def parse_table(output: str) -> list[dict[str, str]]:
    """kubectl's table output as one dict per row, keyed by the header names ("NAME", "READY").

    Columns are cut at the header's word positions, so empty cells read as "" and cells with
    single spaces ("3 (5s ago)", "NOMINATED NODE") stay whole.
    """
    lines = [line for line in output.splitlines() if line.strip()]
    if not lines:
        return []
    heads = list(re.finditer(r"\S+(?: \S+)*", lines[0]))
    bounds = [h.start() for h in heads] + [None]
    return [
        {h.group(): line[bounds[i] : bounds[i + 1]].strip() for i, h in enumerate(heads)}
        for line in lines[1:]
    ]


class ApiServer:
    """A Kubernetes API server (KubeEmu) on 127.0.0.1 for one test; a context manager.

    Attributes, valid inside the `with` block:
    - `url` (str): the base URL, e.g. "http://127.0.0.1:38563" (no trailing slash);
    - `kubeconfig` (pathlib.Path): `<folder>/kubeconfig`, context "emu", namespace "default",
      a dummy bearer token;
    - `emu` (KubeEmu): the emulator, for assertions (`emu.obj("v1/pods", "default", name)`,
      `emu.objs(...)`, `emu.deleted`, `emu.delete_requests`). Read it, but write through the
      API (`request`, `kubectl`): the emulator runs in another thread.
    - `folder` (pathlib.Path): where the kubeconfig and kubectl's cache live.
    """

    def __init__(
        self,
        folder: pathlib.Path,
        *,
        crds: Sequence[pathlib.Path] = (CRD_FILE,),
        namespaces: Sequence[str] = ("default",),
        start_timeout: float = 10.0,
        **emu_options: Any,
    ) -> None:
        """`emu_options` go to `KubeEmu`: `kubelet_finalizes_pods` (default True here),
        `pod_logs` (what `kubectl logs` shows; the kubelet can also set `emu.pod_logs` later),
        `history_size`, `pod_termination_seconds`, `crd_establish_seconds` (CRDs created
        through the API, `crds` included, are served after it), `bookmark_seconds`."""
        emu_options.setdefault("kubelet_finalizes_pods", True)
        self.folder = folder
        self.kubeconfig = folder / "kubeconfig"
        self.emu = KubeEmu(**emu_options)
        self.url = ""
        self._crds = [yaml.safe_load(path.read_text()) for path in crds]
        self._namespaces = list(namespaces)
        self._served = ServedInThread(self.emu, start_timeout)

    def __enter__(self) -> ApiServer:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.url = self._served.__enter__()
        try:
            for name in self._namespaces:
                self.request("POST", "/api/v1/namespaces", {"metadata": {"name": name}}, expect=201)
            for crd in self._crds:
                crds = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
                self.request("POST", crds, crd, expect=201)
            self.kubeconfig.write_text(yaml.safe_dump(self._kubeconfig()))
        except BaseException:
            self._served.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._served.__exit__(*exc)

    def _kubeconfig(self) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "emu",
            "clusters": [{"name": "emu", "cluster": {"server": self.url}}],
            "users": [{"name": "emu", "user": {"token": "kubeemu"}}],
            "contexts": [
                {
                    "name": "emu",
                    "context": {"cluster": "emu", "user": "emu", "namespace": "default"},
                }
            ],
        }

    def env(self) -> dict[str, str]:
        """os.environ with KUBECONFIG pointing here: for kubectl, the operator, any client."""
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig)}

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        content_type: str = JSON,
        headers: Mapping[str, str] | None = None,
        expect: int | Sequence[int] | None = None,
        timeout: float = 10.0,
    ) -> tuple[int, Any]:
        """One API call: (HTTP status, decoded JSON answer or the text when not JSON).

        `path` is the URL path with any query ("/api/v1/namespaces/default/pods?watch=0"); `body`
        is sent as JSON, bytes as they are (a PATCH's `content_type` picks merge, JSON or
        strategic patch). With `expect`, any other status raises AssertionError.
        """
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        hdrs = {"Content-Type": content_type, "Accept": JSON, **(headers or {})}
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=hdrs)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as err:
            status, raw = err.code, err.read()
        try:
            answer: Any = json.loads(raw) if raw else None
        except ValueError:
            answer = raw.decode(errors="replace")
        wanted = [expect] if isinstance(expect, int) else expect
        if wanted is not None and status not in wanted:
            raise AssertionError(f"{method} {path}: HTTP {status}, wanted {expect}: {answer}")
        return status, answer

    def patch_status(
        self, path: str, namespace: str, name: str, status: Mapping[str, Any]
    ) -> dict[str, Any]:
        """Merge-patch an object's `/status` (play a controller or the kubelet); the new object.

        `path` is a resource path like "v1/pods" or "corefleet.dev/v1alpha1/inferenceengines".
        """
        url = f"{collection_url(path, namespace)}/{name}/status"
        _, obj = self.request("PATCH", url, {"status": status}, content_type=MERGE, expect=200)
        return obj  # type: ignore[no-any-return]

    def kubectl(
        self, *args: str, check: bool = True, timeout: float = 30.0, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run the real kubectl against this server (KUBECONFIG set, its own cache folder).

        `--validate=false` is added to apply/create/replace (the emulator serves OpenAPI v3 for
        custom resources only, `kubeemu_openapi`: enough for `kubectl explain ie`, not to validate).
        With `check`, a non-zero exit raises `KubectlError`; past `timeout` seconds kubectl is
        killed and `subprocess.TimeoutExpired` raised.
        """
        if KUBECTL is None:
            raise RuntimeError("kubectl is not installed")
        argv = list(args)
        if (
            argv
            and argv[0] in VALIDATING_VERBS
            and not any(a.startswith("--validate") for a in argv)
        ):
            argv.insert(1, "--validate=false")
        cmd = [KUBECTL, f"--cache-dir={self.folder / 'kube-cache'}", *argv]
        done = subprocess.run(
            cmd, env=self.env(), capture_output=True, text=True, timeout=timeout, input=input
        )
        if check and done.returncode != 0:
            raise KubectlError(done.returncode, cmd, done.stdout, done.stderr)
        return done


def collection_url(path: str, namespace: str | None = None) -> str:
    """The URL path of a resource path ("v1/pods", "apps/v1/deployments") in a namespace."""
    gv, plural = path.rsplit("/", 1)
    root = "/api/v1" if gv == "v1" else f"/apis/{gv}"
    return f"{root}/namespaces/{namespace}/{plural}" if namespace else f"{root}/{plural}"
