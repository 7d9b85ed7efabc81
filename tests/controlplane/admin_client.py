"""What a test does with a cluster as its admin: API calls, object look-ups, and the real kubectl.

`AdminClient` is the part of `ControlPlane` that tests call: requests as the admin, object
look-ups (`obj`, `objs`), the real kubectl with the admin's kubeconfig, and CRDs applied and
waited on until Established.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import ssl
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

JSON = "application/json"
MERGE = "application/merge-patch+json"
KUBECTL: str | None = shutil.which("kubectl")


class KubectlError(subprocess.CalledProcessError):
    """kubectl exited non-zero; the message carries its stderr and stdout."""

    def __str__(self) -> str:
        return (
            f"{' '.join(map(str, self.cmd))} exited {self.returncode}\n"
            f"stderr: {self.stderr}\nstdout: {self.stdout}"
        )


def collection_url(path: str, namespace: str | None = None) -> str:
    """The URL path of a resource path ("v1/pods", "apps/v1/deployments") in a namespace."""
    gv, plural = path.rsplit("/", 1)
    root = "/api/v1" if gv == "v1" else f"/apis/{gv}"
    return f"{root}/namespaces/{namespace}/{plural}" if namespace else f"{root}/{plural}"


class AdminClient:
    """Requests and kubectl as the cluster's admin; `url`, `kubeconfig` and `tls` set by the
    subclass once the API server is up."""

    url: str
    kubeconfig: pathlib.Path
    folder: pathlib.Path
    tls: ssl.SSLContext | None = None

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

        `body` is sent as JSON, bytes as they are (a PATCH's `content_type` picks merge, JSON or
        strategic patch). With `expect`, any other status raises AssertionError.
        """
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        hdrs = {"Content-Type": content_type, "Accept": JSON, **(headers or {})}
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=hdrs)
        try:
            with urllib.request.urlopen(req, timeout=timeout, context=self.tls) as resp:
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

    def get(self, path: str) -> dict[str, Any] | None:
        """GET an object by its URL path; None when it does not exist."""
        status, body = self.request("GET", path)
        if status == 404:
            return None
        if status != 200:
            raise AssertionError(f"GET {path}: HTTP {status}: {body}")
        return body  # type: ignore[no-any-return]

    def obj(self, path: str, namespace: str, name: str) -> dict[str, Any] | None:
        """One object by resource path ("v1/pods"), namespace ("" when cluster-scoped) and
        name; None when it does not exist."""
        return self.get(f"{collection_url(path, namespace or None)}/{name}")

    def objs(
        self, path: str, namespace: str | None = None, selector: str = ""
    ) -> list[dict[str, Any]]:
        """Every object of a resource path (in one namespace when given; a label selector)."""
        url = collection_url(path, namespace or None)
        if selector:
            url += "?labelSelector=" + urllib.parse.quote(selector)
        found = self.get(url)
        return list((found or {}).get("items") or [])

    def patch_status(
        self, path: str, namespace: str, name: str, status: Mapping[str, Any]
    ) -> dict[str, Any]:
        """Merge-patch an object's `/status` (play a controller); the new object."""
        url = f"{collection_url(path, namespace)}/{name}/status"
        _, obj = self.request("PATCH", url, {"status": status}, content_type=MERGE, expect=200)
        return obj  # type: ignore[no-any-return]

    def apply_crds(self, path: pathlib.Path, timeout: float = 120.0) -> None:
        """`kubectl apply` a file (or folder) of CRDs and wait until their kinds are served.

        Polled through the API: `kubectl wait --for=condition=Established` fails at once when
        it reads a CRD the server has not given any condition yet (kubernetes/kubernetes#66439).
        """
        self.kubectl("apply", "-f", str(path), timeout=60)
        self.wait_crds_established(path, timeout=timeout)

    def wait_crds_established(self, *paths: pathlib.Path, timeout: float = 120.0) -> None:
        """Wait until every CRD in the files (or folders of files) is Established."""
        files = [f for p in paths for f in (sorted(p.glob("*.yaml")) if p.is_dir() else [p])]
        for doc in (d for f in files for d in yaml.safe_load_all(f.read_text()) if d):
            if doc.get("kind") == "CustomResourceDefinition":
                self.wait_established(doc["metadata"]["name"], timeout)

    def wait_established(self, crd: str, timeout: float = 120.0) -> None:
        """Wait until the CRD `crd` has Established=True."""
        url = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd}"

        def established() -> bool:
            conditions = ((self.get(url) or {}).get("status") or {}).get("conditions") or []
            return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)

        deadline = time.monotonic() + timeout
        while not established():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {crd} Established")
            time.sleep(0.1)

    def kubectl(
        self, *args: str, check: bool = True, timeout: float = 30.0, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run the real kubectl against this cluster (KUBECONFIG set, its own cache folder).

        With `check`, a non-zero exit raises `KubectlError`; past `timeout` seconds kubectl is
        killed and `subprocess.TimeoutExpired` raised.
        """
        if KUBECTL is None:
            raise RuntimeError("kubectl is not installed")
        cmd = [KUBECTL, f"--cache-dir={self.folder / 'kube-cache'}", *args]
        done = subprocess.run(
            cmd, env=self.env(), capture_output=True, text=True, timeout=timeout, input=input
        )
        if check and done.returncode != 0:
            raise KubectlError(done.returncode, cmd, done.stdout, done.stderr)
        return done
