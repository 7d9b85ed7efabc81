"""The coordinator's HTTP/1.1 protocol: uvicorn's httptools protocol, plus two things.

- **A deadline and a size bound on each request head.** uvicorn closes a connection idle
  *between* requests (``timeout_keep_alive``) but waits forever for the head of one: a client
  that connects and sends nothing, or sends its headers a byte at a time (slowloris), holds a
  connection for good. Here a head not complete within ``head_timeout_s`` of its first byte
  (or of the connection) closes the connection, and one past :data:`MAX_HEAD_BYTES` or
  :data:`MAX_HEADERS` gets 431.
- **The generation POSTs without ASGI.** ``POST /v1/completions`` and
  ``/v1/chat/completions`` go from the parser straight to :class:`NativeRoutes` (the
  coordinator's ``GenerationApi``) and their answer straight to the socket: a JSON answer in
  one write, a stream as chunked server-sent events. Under uvicorn's ASGI cycle and
  Starlette's request and response objects, those layers cost more CPU per short request than
  the coordinator's own work (``benchmarks/README.md``, ``coordinator.py``). Everything else
  (other routes, a request pipelined behind another, a connection over the limit) takes
  uvicorn's ASGI path to the app, which serves the same POSTs the same way.

A native request keeps uvicorn's per-connection rules: it stands in uvicorn's ``cycle`` slot
(:class:`NativeExchange` has the attributes the protocol reads), so a request pipelined
behind it waits its turn, and its task is among the server's tasks, which a graceful shutdown
waits for. Its body is bounded (413, by ``Content-Length`` or as it arrives) and timed (408),
as the ASGI path's ``read_body`` does; a client that goes away cancels its task, which aborts
its generation.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any, Protocol

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from corefleet.engine.openai.admission import body_too_large
from corefleet.engine.openai.errors import RequestError
from corefleet.engine.openai.replies import JsonReply, Reply, StreamReply, error_reply
from corefleet.engine.openai.server_options import route_path

logger = logging.getLogger(__name__)

_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_JSON_TYPE = b"content-type: application/json\r\n"
_SSE_TYPE = b"content-type: text/event-stream; charset=utf-8\r\n"
_CHUNKED = b"transfer-encoding: chunked\r\n"
_CLOSE = b"connection: close\r\n"
_LAST_CHUNK = b"0\r\n\r\n"

# A request head (request line and headers) larger than this, or with more header lines, gets
# 431 and the connection is closed. llhttp, httptools' parser, has no bound of its own and
# uvicorn's protocol keeps every header it is given, so without these one head could grow
# until the head deadline (2,000,000 headers took 245 MB); h11 stops at 16 KiB.
MAX_HEAD_BYTES = 64 * 1024
MAX_HEADERS = 128


class _HeadTooLarge(Exception):
    """Raised from a parser callback to stop parsing a head past the bounds."""


class NativeRoutes(Protocol):
    """What the protocol serves itself: ``serve`` answers a POST to one of ``endpoints``."""

    endpoints: dict[str, Any]

    def serve(self, path: str, body: bytes, authorization: str | None) -> Awaitable[Reply]: ...

    def closing(self) -> bool:
        """True while the server shuts down: every answer then closes its connection."""
        ...


class _NoWaiters:
    """uvicorn sets its cycle's ``message_event`` when the connection is lost; a native
    request waits on its task instead."""

    def set(self) -> None:
        pass


class NativeExchange:
    """One generation POST served by the protocol, in uvicorn's ``cycle`` slot."""

    message_event = _NoWaiters()

    def __init__(self, path: str, authorization: str | None, keep_alive: bool, chunked: bool):
        self.path = path
        self.authorization = authorization
        self.keep_alive = keep_alive  # uvicorn clears it when the server stops
        self.chunked = chunked  # HTTP/1.1: a stream is sent in chunks; 1.0: until the close
        self.parts: list[bytes] = []
        self.size = 0
        self.body_timer: asyncio.TimerHandle | None = None
        self.task: asyncio.Task[None] | None = None
        self.response_complete = False
        self.disconnected = False  # set by uvicorn when the connection is lost


class CoordinatorProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a head deadline and the native generation routes.

    The class attributes are set per server by :func:`coordinator_protocol`.
    """

    head_timeout_s = 10.0
    routes: NativeRoutes | None = None
    max_body_bytes = 4 * 1024 * 1024
    body_timeout_s = 30.0
    # --root-path: a path under it is routed without it, as the app routes it. Not uvicorn's
    # own root_path (an instance attribute of its protocol, which would prefix every ASGI path).
    route_root = ""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._awaiting_head = True  # until a request's head is complete
        self._head_bytes = 0
        self._head_refused: str | None = None  # why a head was too large

    # -- the head's bounds -----------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4)  # and ": " and CRLF
        if len(self.headers) >= MAX_HEADERS:
            self._head_refused = f"more than {MAX_HEADERS} header lines"
            raise _HeadTooLarge
        super().on_header(name, value)

    def _count_head(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > MAX_HEAD_BYTES:
            self._head_refused = f"a request head over {MAX_HEAD_BYTES} bytes"
            raise _HeadTooLarge

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to what the parser refused; a head past the bounds gets 431."""
        if self._head_refused is None:
            super().send_400_response(msg)
            return
        body = f"Request Header Fields Too Large: {self._head_refused}".encode()
        self.transport.write(
            b"".join(
                (
                    STATUS_LINE[431],
                    b"content-type: text/plain; charset=utf-8\r\n",
                    b"content-length: %d\r\n" % len(body),
                    _CLOSE,
                    b"\r\n",
                    body,
                )
            )
        )
        self.transport.close()

    # -- the head deadline ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[arg-type]
        self._arm_head_timer()  # a client that connects and says nothing

    def data_received(self, data: bytes) -> None:
        if self._awaiting_head:  # bytes of a head: it must complete in time
            self._arm_head_timer()
        super().data_received(data)  # on_headers_complete stops the clock

    def on_message_complete(self) -> None:
        self._awaiting_head = True
        exchange = self.cycle
        if not isinstance(exchange, NativeExchange):
            super().on_message_complete()
        elif not exchange.response_complete:
            self._start(exchange)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        exchange = self.cycle
        super().connection_lost(exc)
        if isinstance(exchange, NativeExchange) and not exchange.response_complete:
            _cancel(exchange.body_timer)
            if exchange.task is not None:
                exchange.task.cancel()  # the client is gone: abort its generation

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        _cancel(self._head_timer)
        self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self._awaiting_head or self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self._arm_head_timer()  # an answer is still going out: the next head waits for it
            return
        self.transport.close()

    def shutdown(self) -> None:
        """The server stops: this connection finishes its request and may serve one more.

        uvicorn closes an idle connection at once and a busy one the moment its response ends.
        A response that began before the stop carries no ``Connection: close``, so its client
        may send its next request on the connection as that response ends, and lose it to the
        close (the keep-alive race; the async OpenAI client reuses a connection that fast).
        Left open, the connection serves that request with ``Connection: close`` (every
        answer has it while the server closes), then closes; one that stays idle closes at
        its keep-alive timeout, and a half-sent head at its head timeout. The server waits
        for them within its graceful-shutdown timeout.
        """

    # -- the native generation routes ----------------------------------------------------

    def on_headers_complete(self) -> None:
        self._awaiting_head = False  # the head is in; the request takes over
        self._cancel_head_timer()
        path = self._native_path()
        if path is None:
            super().on_headers_complete()
            return
        version = self.parser.get_http_version()
        keep_alive = version != "1.0" and self.parser.should_keep_alive()
        fields = dict(self.headers)  # (lower-case name, value); the last of a name wins
        authorization = fields.get(b"authorization")
        exchange = NativeExchange(
            path,
            None if authorization is None else authorization.decode("latin-1"),
            keep_alive,
            chunked=version == "1.1",
        )
        self.cycle = exchange  # type: ignore[assignment]
        declared = fields.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            self._refuse(exchange, body_too_large(self.max_body_bytes))
            return
        if self.expect_100_continue:
            self.transport.write(_CONTINUE)
        exchange.body_timer = self.loop.call_later(
            self.body_timeout_s, self._body_timed_out, exchange
        )

    def on_body(self, body: bytes) -> None:
        exchange = self.cycle
        if not isinstance(exchange, NativeExchange):
            super().on_body(body)
            return
        if exchange.response_complete:
            return
        exchange.size += len(body)
        if exchange.size > self.max_body_bytes:
            self._refuse(exchange, body_too_large(self.max_body_bytes))
            return
        exchange.parts.append(body)

    def _native_path(self) -> str | None:
        """The path of a request this protocol serves itself, or None for uvicorn's ASGI."""
        if self.routes is None or self.parser.get_method() != b"POST":
            return None
        path = route_path(self.url.partition(b"?")[0].decode("latin-1"), self.route_root)
        if path not in self.routes.endpoints or self.parser.should_upgrade():
            return None
        if self.cycle is not None and not self.cycle.response_complete:
            return None  # pipelined behind a request in flight: uvicorn queues it
        limit = self.limit_concurrency
        if limit is not None and (len(self.connections) >= limit or len(self.tasks) >= limit):
            return None  # uvicorn answers 503
        return path

    def _body_timed_out(self, exchange: NativeExchange) -> None:
        exchange.body_timer = None
        if exchange.task is None and not exchange.response_complete:
            timeout = self.body_timeout_s
            self._refuse(
                exchange,
                RequestError(
                    f"the request body did not arrive within {timeout:g} s (--body-timeout)",
                    status=408,
                    code="request_timeout",
                ),
            )

    def _refuse(self, exchange: NativeExchange, err: RequestError) -> None:
        """Answer ``err`` before the body is read, and close: the rest of it is not read."""
        _cancel(exchange.body_timer)
        exchange.keep_alive = False
        self._write_json(exchange, error_reply(err))
        exchange.response_complete = True
        self.transport.close()

    def _start(self, exchange: NativeExchange) -> None:
        _cancel(exchange.body_timer)
        task = self.loop.create_task(self._run(exchange))
        exchange.task = task
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _run(self, exchange: NativeExchange) -> None:
        assert self.routes is not None
        body = b"".join(exchange.parts)
        exchange.parts = []
        try:
            reply = await self.routes.serve(exchange.path, body, exchange.authorization)
        except Exception:
            logger.exception("POST %s failed", exchange.path)
            reply = error_reply(RequestError("internal server error", status=500))
        if self.routes.closing():
            exchange.keep_alive = False
        if isinstance(reply, StreamReply):
            await self._stream(exchange, reply)
        else:
            self._write_json(exchange, reply)
        self._finish(exchange)

    def _write_json(self, exchange: NativeExchange, reply: JsonReply) -> None:
        head = self._head(exchange, reply.status, _JSON_TYPE, reply.headers)
        length = b"content-length: %d\r\n\r\n" % len(reply.body)
        self.transport.write(b"".join((head, length, reply.body)))

    async def _stream(self, exchange: NativeExchange, reply: StreamReply) -> None:
        """Send ``reply``'s events as they come, keeping to the client's pace."""
        framing = _CHUNKED if exchange.chunked else b""
        if not exchange.chunked:
            exchange.keep_alive = False  # HTTP/1.0: the close ends the body
        self.transport.write(self._head(exchange, 200, _SSE_TYPE, {}) + framing + b"\r\n")
        try:
            async for event in reply.events:
                data = event.encode()
                if exchange.chunked:
                    data = b"%x\r\n%s\r\n" % (len(data), data)
                self.transport.write(data)
                if self.flow.write_paused:
                    await self.flow.drain()
            if exchange.chunked:
                self.transport.write(_LAST_CHUNK)
        except Exception:  # a bug: the client sees the stream cut short
            logger.exception("the stream of POST %s failed", exchange.path)
            exchange.keep_alive = False
        finally:
            await reply.events.aclose()  # type: ignore[attr-defined]

    def _head(
        self, exchange: NativeExchange, status: int, content_type: bytes, extra: Any
    ) -> bytes:
        """The status line and headers, up to (not including) the blank line."""
        lines = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:  # server, date
            lines += (name, b": ", value, b"\r\n")
        lines.append(content_type)
        for name, value in extra.items():
            lines.append(f"{name}: {value}\r\n".encode("latin-1"))
        if not exchange.keep_alive:
            lines.append(_CLOSE)
        return b"".join(lines)

    def _finish(self, exchange: NativeExchange) -> None:
        exchange.response_complete = True
        if not exchange.keep_alive:
            self.transport.close()
        self.on_response_complete()  # the next pipelined request, or the keep-alive timer


def _cancel(timer: asyncio.TimerHandle | None) -> None:
    if timer is not None:
        timer.cancel()


def coordinator_protocol(
    head_timeout_s: float,
    routes: NativeRoutes | None = None,
    max_body_bytes: int = CoordinatorProtocol.max_body_bytes,
    body_timeout_s: float = CoordinatorProtocol.body_timeout_s,
    root_path: str = "",
) -> type[CoordinatorProtocol]:
    """The protocol class for one server: heads due within ``head_timeout_s``, and ``routes``
    (if any, at their paths or under ``root_path``) served natively with bodies of at most
    ``max_body_bytes`` due within ``body_timeout_s``."""
    attributes = {
        "head_timeout_s": head_timeout_s,
        "routes": routes,
        "max_body_bytes": max_body_bytes,
        "body_timeout_s": body_timeout_s,
        "route_root": root_path,
    }
    return type("CoordinatorProtocol", (CoordinatorProtocol,), attributes)
