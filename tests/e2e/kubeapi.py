"""The few Kubernetes API calls the local kubelet makes, over HTTPS with its node credentials.

It talks to the API server only through its HTTP interface, as a real kubelet does, so what it
sees is what kubectl and the operator see, and what RBAC and the Node authorizer let a node do.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Mapping
from typing import Any

import aiohttp

MERGE = {"Content-Type": "application/merge-patch+json"}


class ApiError(RuntimeError):
    """The API server answered with an error status."""

    def __init__(self, status: int, body: Any) -> None:
        message = body.get("message") if isinstance(body, Mapping) else body
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


def collection_url(group_version: str, plural: str, namespace: str | None = None) -> str:
    """`/api/v1/...` or `/apis/G/V/...`, namespaced when `namespace` is given."""
    root = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
    return f"{root}/namespaces/{namespace}/{plural}" if namespace else f"{root}/{plural}"


class KubeApi:
    """An aiohttp session bound to one API server URL."""

    def __init__(self, base_url: str, tls: ssl.SSLContext | None = None) -> None:
        """`tls` carries the CA and the client certificate (None: plain HTTP, the emulator)."""
        self.base_url = base_url.rstrip("/")
        self._tls = tls
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> KubeApi:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=10),
            connector=aiohttp.TCPConnector(ssl=self._tls if self._tls is not None else True),
        )
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._session is not None:
            await self._session.close()

    async def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        headers: Mapping[str, str] | None = None,
        ok_missing: bool = False,
    ) -> Any:
        """One request; the decoded answer, None on 404 when `ok_missing`, else ApiError."""
        assert self._session is not None, "use KubeApi as an async context manager"
        data = None if body is None else json.dumps(body)
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        async with self._session.request(
            method, self.base_url + path, data=data, headers=hdrs
        ) as resp:
            answer = await resp.json(content_type=None)
            if resp.status == 404 and ok_missing:
                return None
            if resp.status >= 300:
                raise ApiError(resp.status, answer)
            return answer

    async def list(
        self, group_version: str, plural: str, namespace: str | None = None, query: str = ""
    ) -> list[dict[str, Any]]:
        """Every object of a resource (in all namespaces unless one is given); `query` is a URL
        query such as "fieldSelector=spec.nodeName%3Dnode"."""
        url = collection_url(group_version, plural, namespace)
        doc = await self.call("GET", f"{url}?{query}" if query else url)
        return list(doc.get("items") or [])

    async def get(
        self, group_version: str, plural: str, namespace: str, name: str
    ) -> dict[str, Any] | None:
        """One object, or None when it does not exist."""
        url = f"{collection_url(group_version, plural, namespace)}/{name}"
        return await self.call("GET", url, ok_missing=True)  # type: ignore[no-any-return]

    async def create(
        self, group_version: str, plural: str, namespace: str, body: Mapping[str, Any]
    ) -> dict[str, Any]:
        """POST a new object."""
        url = collection_url(group_version, plural, namespace)
        return await self.call("POST", url, body)  # type: ignore[no-any-return]

    async def patch(
        self,
        group_version: str,
        plural: str,
        namespace: str,
        name: str,
        body: Mapping[str, Any],
        subresource: str = "",
    ) -> dict[str, Any] | None:
        """Merge-patch an object (or its subresource); None when it is gone."""
        url = f"{collection_url(group_version, plural, namespace)}/{name}"
        url += f"/{subresource}" if subresource else ""
        return await self.call("PATCH", url, body, MERGE, ok_missing=True)  # type: ignore[no-any-return]

    async def delete(
        self,
        group_version: str,
        plural: str,
        namespace: str,
        name: str,
        grace_seconds: int | None = None,
        uid: str | None = None,
    ) -> None:
        """DELETE an object (gracefully unless `grace_seconds` is 0); a missing one is fine.
        With `uid`, only that object: a newer one of the same name stays (a 409 is fine too)."""
        url = f"{collection_url(group_version, plural, namespace)}/{name}"
        body: dict[str, Any] | None = None
        if grace_seconds is not None or uid is not None:
            body = {"kind": "DeleteOptions", "apiVersion": "v1"}
        if grace_seconds is not None:
            url += f"?gracePeriodSeconds={grace_seconds}"
            body = {**(body or {}), "gracePeriodSeconds": grace_seconds}
        if uid is not None:
            body = {**(body or {}), "preconditions": {"uid": uid}}
        await self.call("DELETE", url, body, ok_missing=True)
