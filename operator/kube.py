"""A small async Kubernetes API client for the operator's own writes.

kopf watches and patches the InferenceEngines, but has no public client for other objects, so the
children are written here: create, merge-patch, delete and get, over aiohttp (already a kopf
dependency), with the credentials kopf's login produced (`kopf.ConnectionInfo`). It is built in the
login handler and closed in the cleanup handler (`main.py`); nothing connects at import time.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import ssl
import tempfile
import urllib.parse
from collections.abc import Iterator, Mapping
from typing import Any

import aiohttp
import kopf

# kind -> (API path prefix, plural). The only kinds the operator ever reads or writes.
KINDS: dict[str, tuple[str, str]] = {
    "Pod": ("api/v1", "pods"),
    "Service": ("api/v1", "services"),
    "ConfigMap": ("api/v1", "configmaps"),
    "Secret": ("api/v1", "secrets"),
    "PersistentVolumeClaim": ("api/v1", "persistentvolumeclaims"),
    "Deployment": ("apis/apps/v1", "deployments"),
    "PodDisruptionBudget": ("apis/policy/v1", "poddisruptionbudgets"),
    "NetworkPolicy": ("apis/networking.k8s.io/v1", "networkpolicies"),
    "HorizontalPodAutoscaler": ("apis/autoscaling/v2", "horizontalpodautoscalers"),
    "InferenceEngine": ("apis/corefleet.dev/v1alpha1", "inferenceengines"),
}


def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """The operator's credentials: the in-cluster service account first, then KUBECONFIG.

    kopf's login handler (`main.login_handler`) and the peering pre-flight (`peering.py`) both
    use it, so every request of the operator runs as the same identity.
    """
    kwargs.setdefault("settings", kopf.OperatorSettings())
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


class KubeError(Exception):
    """An API answer the caller did not expect: HTTP status plus the server's message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


def _decode(data: str | bytes) -> bytes:
    raw = data.encode() if isinstance(data, str) else data
    return raw if raw.lstrip().startswith(b"-----") else base64.b64decode(raw)


@contextlib.contextmanager
def _as_file(path: Any, data: str | bytes | None) -> Iterator[str | None]:
    if path is not None:
        yield os.fspath(path) if not isinstance(path, bytes) else path.decode()
        return
    if data is None:
        yield None
        return
    with tempfile.NamedTemporaryFile(suffix=".pem") as handle:
        handle.write(_decode(data))
        handle.flush()
        yield handle.name


def ssl_context(info: kopf.ConnectionInfo) -> ssl.SSLContext | bool:
    """The TLS settings for a kopf ConnectionInfo (False: verification off, as configured)."""
    if info.insecure:
        return False
    cadata = _decode(info.ca_data).decode() if info.ca_data else None
    cafile = os.fspath(info.ca_path) if info.ca_path else None
    ctx = ssl.create_default_context(cafile=cafile, cadata=cadata)
    with (
        _as_file(info.certificate_path, info.certificate_data) as cert,
        _as_file(info.private_key_path, info.private_key_data) as key,
    ):
        if cert is not None:
            ctx.load_cert_chain(certfile=cert, keyfile=key)
    return ctx


class KubeClient:
    """Create/patch/delete/get namespaced objects of the `KINDS` above."""

    def __init__(self, info: kopf.ConnectionInfo, timeout: float = 10.0) -> None:
        self._server = info.server.rstrip("/")
        self._headers = {"Accept": "application/json", "User-Agent": "corefleet-operator"}
        if info.token:
            self._headers["Authorization"] = f"{info.scheme or 'Bearer'} {info.token}"
        self._auth = (
            aiohttp.BasicAuth(info.username, info.password or "") if info.username else None
        )
        self._ssl = ssl_context(info) if self._server.startswith("https") else False
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None

    def url(
        self, kind: str, namespace: str, name: str | None = None, subresource: str | None = None
    ) -> str:
        """The API URL of a kind in a namespace, optionally of one object and a subresource."""
        prefix, plural = KINDS[kind]
        parts = [self._server, prefix, "namespaces", namespace, plural, name, subresource]
        return "/".join(p for p in parts if p)

    async def _request(
        self, method: str, url: str, body: Any = None, content_type: str = "application/json"
    ) -> tuple[int, Any]:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                headers=self._headers, auth=self._auth, timeout=self._timeout
            )
        headers = {"Content-Type": content_type} if body is not None else {}
        async with self._session.request(
            method, url, json=body, headers=headers, ssl=self._ssl
        ) as resp:
            text = await resp.text() if resp.content_length != 0 else ""
        if not text.strip():
            return resp.status, None
        try:
            return resp.status, json.loads(text)
        except ValueError:  # not JSON: a real server's "404 page not found" for a group it lacks
            return resp.status, text

    @staticmethod
    def _check(status: int, data: Any, allowed: tuple[int, ...]) -> Any:
        if 200 <= status < 300:
            return data
        if status in allowed:
            return None
        message = data.get("message", "") if isinstance(data, Mapping) else str(data)
        raise KubeError(status, message)

    async def create(self, manifest: Mapping[str, Any]) -> dict[str, Any] | None:
        """Create an object; None if it already exists (409)."""
        meta = manifest["metadata"]
        status, data = await self._request(
            "POST", self.url(manifest["kind"], meta["namespace"]), dict(manifest)
        )
        return self._check(status, data, (409,))

    async def patch(
        self,
        kind: str,
        namespace: str,
        name: str,
        patch: Mapping[str, Any],
        subresource: str | None = None,
    ) -> dict[str, Any] | None:
        """JSON-merge-patch an object; None if it does not exist (404)."""
        url = self.url(kind, namespace, name, subresource)
        status, data = await self._request(
            "PATCH", url, dict(patch), "application/merge-patch+json"
        )
        return self._check(status, data, (404,))

    async def delete(self, kind: str, namespace: str, name: str) -> None:
        """Delete an object (its grace period runs); absent objects are fine."""
        status, data = await self._request("DELETE", self.url(kind, namespace, name))
        self._check(status, data, (404,))

    async def list_labelled(self, kind: str, namespace: str, selector: str) -> list[dict[str, Any]]:
        """The objects of a kind in a namespace that match a label selector."""
        url = f"{self.url(kind, namespace)}?{urllib.parse.urlencode({'labelSelector': selector})}"
        status, data = await self._request("GET", url)
        return list((self._check(status, data, ()) or {}).get("items") or [])

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """Read an object; None if it does not exist."""
        status, data = await self._request("GET", self.url(kind, namespace, name))
        return self._check(status, data, (404,))

    async def read(self, path: str) -> dict[str, Any] | None:
        """GET any API path (`apis/GROUP/VERSION/...`); None if the server answers 404."""
        status, data = await self._request("GET", f"{self._server}/{path.lstrip('/')}")
        return self._check(status, data, (404,))

    async def close(self) -> None:
        """Close the HTTP session (idempotent)."""
        if self._session is not None:
            await self._session.close()
            self._session = None
