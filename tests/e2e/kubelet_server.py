"""The local kubelet's HTTPS endpoint: container logs, which `kubectl logs` reaches through the
API server.

kube-apiserver serves `pods/log` by dialling the node's address (its InternalIP here, by
`--kubelet-preferred-address-types`) at the port the Node's `daemonEndpoints` gives, with its
kubelet client certificate, and GETs `/containerLogs/<ns>/<pod>/<container>` with the query
`kubectl logs` chose (`follow`, `tailLines`, `limitBytes`, `previous`). This server answers that
from the container's log file: all runs of the container (this node keeps no separate file per
run, so `previous` shows the same), the last `tailLines` lines, at most `limitBytes` bytes, and
with `follow` the new lines as they come until the pod is gone or the client leaves. Client
certificates are required and checked against the cluster's CA, as a kubelet does.
"""

from __future__ import annotations

import asyncio
import pathlib
import ssl
from collections.abc import Callable

from aiohttp import web

FOLLOW_POLL_S = 0.2
LogPath = Callable[[str, str], pathlib.Path | None]  # (namespace, pod) -> the log file, if live


def _tail(data: bytes, lines: int | None) -> bytes:
    if lines is None:
        return data
    if lines <= 0:
        return b""
    parts = data.splitlines(keepends=True)
    return b"".join(parts[-lines:])


def _int(query: str | None) -> int | None:
    return int(query) if query is not None and query.lstrip("-").isdigit() else None


class KubeletServer:
    """Serves `/containerLogs` on 127.0.0.1:`port` with TLS; `start()` in the kubelet's loop."""

    def __init__(self, tls: ssl.SSLContext, port: int, log_path: LogPath) -> None:
        self.tls, self.port, self._log_path = tls, port, log_path
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/containerLogs/{namespace}/{pod}/{container}", self._logs)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port, ssl_context=self.tls).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _logs(self, request: web.Request) -> web.StreamResponse:
        namespace, pod = request.match_info["namespace"], request.match_info["pod"]
        path = self._log_path(namespace, pod)
        if path is None:
            raise web.HTTPNotFound(text=f'pod "{pod}" in namespace "{namespace}" is not here')
        data = path.read_bytes() if path.exists() else b""
        data = _tail(data, _int(request.query.get("tailLines")))
        limit = _int(request.query.get("limitBytes"))
        if limit is not None:
            data = data[:limit]
        response = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await response.prepare(request)
        await response.write(data)
        if request.query.get("follow") in ("true", "1") and limit is None:
            await self._follow(
                response, namespace, pod, path.stat().st_size if path.exists() else 0
            )
        await response.write_eof()
        return response

    async def _follow(
        self, response: web.StreamResponse, namespace: str, pod: str, offset: int
    ) -> None:
        while True:
            path = self._log_path(namespace, pod)
            if path is None:
                return  # the pod is gone: the stream ends, as the kubelet's does
            if path.exists() and path.stat().st_size > offset:
                with open(path, "rb") as handle:
                    handle.seek(offset)
                    chunk = handle.read()
                offset += len(chunk)
                try:
                    await response.write(chunk)
                except (ConnectionResetError, RuntimeError):
                    return
            await asyncio.sleep(FOLLOW_POLL_S)
