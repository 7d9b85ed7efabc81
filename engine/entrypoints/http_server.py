"""The coordinator's HTTP server: uvicorn with the coordinator's own protocol, hardened
against idle and slow clients.

uvicorn closes a connection idle *between* requests (``timeout_keep_alive``) and answers 503
beyond ``limit_concurrency`` connections; the protocol (``http_protocol.py``) adds a deadline
on each request head (slowloris) and serves the generation POSTs without ASGI.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import resource
import signal
import socket
from collections.abc import Iterator
from types import FrameType
from typing import Any

import uvicorn

from corefleet.engine.entrypoints.http_protocol import NativeRoutes, coordinator_protocol
from corefleet.engine.openai.limits import RequestLimits
from corefleet.engine.openai.server_state import ServerState

logger = logging.getLogger(__name__)

# Files and sockets the process needs besides client connections: the model and tokenizer,
# ZMQ's sockets and pipes (a few per rank), logs.
_FD_RESERVE = 256


def connection_budget(wanted: int) -> int:
    """How many connections this process can hold: ``wanted``, after raising the soft limit
    on open files towards the hard one, less a reserve for the process's own files and
    sockets. Beyond the file limit, accept() fails and uvicorn logs errors instead of
    answering 503."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted + _FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < target:
        raised = target if hard == resource.RLIM_INFINITY else min(target, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
    if soft == resource.RLIM_INFINITY or soft >= target:
        return wanted
    budget = max(1, soft - _FD_RESERVE)
    logger.warning(
        "only %d open files allowed (ulimit -n): serving at most %d connections, not %d",
        soft,
        budget,
        wanted,
    )
    return budget


def uvicorn_config(
    app: Any,
    host: str,
    port: int,
    limits: RequestLimits,
    shutdown_timeout_s: float,
    routes: NativeRoutes | None = None,
    root_path: str = "",
) -> uvicorn.Config:
    """uvicorn's configuration for the API: the connection limits of ``limits``, and
    ``routes`` (the generation POSTs) served by the protocol itself, with or without the
    ``root_path`` prefix (``--root-path``; the app applies it to the rest)."""
    protocol = coordinator_protocol(
        limits.header_timeout_s,
        routes,
        limits.max_request_body_bytes,
        limits.body_timeout_s,
        root_path,
    )
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=protocol,
        limit_concurrency=connection_budget(limits.max_connections),
        timeout_keep_alive=limits.keep_alive_timeout_s,
        timeout_graceful_shutdown=int(shutdown_timeout_s),
        log_level="warning",
    )


class ApiServer(uvicorn.Server):
    """uvicorn, with readiness dropped the moment a shutdown signal arrives.

    With ``shutdown_delay_s`` the stop itself (no new connections, open requests finish) comes
    that much later: meanwhile ``/ready`` says 503, so the Service's endpoints drop this pod
    while it still serves whoever has not noticed yet, and every response closes its
    connection. A second signal stops at once. Stopping closes the listening socket; the
    connections already open serve what they are sent until they close (see
    ``CoordinatorProtocol.shutdown``).
    """

    def __init__(
        self, config: uvicorn.Config, state: ServerState, shutdown_delay_s: float = 0.0
    ) -> None:
        super().__init__(config)
        self.state = state
        self.shutdown_delay_s = shutdown_delay_s
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        first = not self.state.shutting_down
        self.state.shutting_down = True
        if first and self.shutdown_delay_s > 0 and self._loop is not None:
            logger.info(
                "%s: not ready now, stopping in %.1f s",
                signal.Signals(sig).name,
                self.shutdown_delay_s,
            )
            stop = functools.partial(uvicorn.Server.handle_exit, self, sig, frame)
            # A signal handler may not touch the loop's timers directly: hand it over.
            self._loop.call_soon_threadsafe(self._loop.call_later, self.shutdown_delay_s, stop)
            return
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn re-raises a captured SIGTERM after its graceful shutdown, which would kill
        # the process before the ranks are stopped (and exit -15); a planned shutdown exits 0.
        handled = (signal.SIGTERM, signal.SIGINT)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
