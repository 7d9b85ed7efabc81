"""The coordinator's HTTP server: uvicorn, hardened against idle and slow clients.

uvicorn closes a connection idle *between* requests (``timeout_keep_alive``) and answers 503
beyond ``limit_concurrency`` connections, but it waits forever for the head of a request: a
client that connects and sends nothing, or sends its headers a byte at a time (slowloris),
holds a connection for good, and enough of them exhaust the limit. :func:`head_timeout_protocol`
adds the missing deadline: a connection whose request head is not complete within
``header_timeout_s`` of its first byte (or of connecting) is closed.
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

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from corefleet.engine.openai.api_server import ServerState
from corefleet.engine.openai.limits import RequestLimits

logger = logging.getLogger(__name__)

# Files and sockets the process needs besides client connections: the model and tokenizer,
# ZMQ's sockets and pipes (a few per rank), logs.
_FD_RESERVE = 256


class _HeadTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on receiving each request head."""

    head_timeout_s = 10.0  # set per server by head_timeout_protocol()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[arg-type]
        self._arm_head_timer()  # a client that connects and says nothing

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:  # bytes of a head: it must complete in time
            self._arm_head_timer()
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the head is in; the app takes over
            self._cancel_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def shutdown(self) -> None:
        """The server stops: this connection finishes its request and may serve one more.

        uvicorn closes an idle connection at once and a busy one the moment its response ends.
        A response that began before the stop carries no ``Connection: close``, so its client
        may send its next request on the connection as that response ends, and lose it to the
        close (the keep-alive race; the async OpenAI client reuses a connection that fast).
        Left open, the connection serves that request with ``Connection: close`` (``ApiFront``
        adds it while the server closes), then closes; one that stays idle closes at its
        keep-alive timeout, and a half-sent head at its head timeout. The server waits for
        them within its graceful-shutdown timeout.
        """

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def head_timeout_protocol(timeout_s: float) -> type[H11Protocol]:
    """An h11 protocol class for uvicorn whose request heads must arrive within
    ``timeout_s``."""
    return type("HeadTimeoutProtocol", (_HeadTimeoutProtocol,), {"head_timeout_s": timeout_s})


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
    app: Any, host: str, port: int, limits: RequestLimits, shutdown_timeout_s: float
) -> uvicorn.Config:
    """uvicorn's configuration for the API: the connection limits of ``limits``."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=head_timeout_protocol(limits.header_timeout_s),
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
    ``_HeadTimeoutProtocol.shutdown``).
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
