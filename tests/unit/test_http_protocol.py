"""The coordinator's HTTP protocol (``engine/entrypoints/http_protocol.py``) on a real uvicorn
server and real sockets: the generation POSTs answered without ASGI keep HTTP/1.1's rules
(keep-alive, pipelining in order, ``Expect: 100-continue``, chunked bodies both ways, HTTP/1.0),
the body's limits (413, 408), a client that goes away, and a server that closes.

The routes here are a small echo of the real ``GenerationApi``'s interface, so each rule is
seen without ranks; ``test_serve.py`` and ``test_hostile_clients.py`` run the real one.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import uvicorn
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from corefleet.engine.entrypoints.http_server import uvicorn_config
from corefleet.engine.openai.admission import ApiKeys
from corefleet.engine.openai.front import ApiFront, reply_response
from corefleet.engine.openai.limits import RequestLimits
from corefleet.engine.openai.replies import Reply, StreamReply, json_reply

GENERATION = "/v1/completions"
HEAD_CHUNKED = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"


class EchoRoutes:
    """Answers a generation POST with what it received, or streams ``events`` events."""

    def __init__(self) -> None:
        self.endpoints = {GENERATION: None, "/v1/chat/completions": None}
        self.is_closing = False
        self.streams_closed = 0

    def closing(self) -> bool:
        return self.is_closing

    async def serve(self, path: str, body: bytes, authorization: str | None) -> Reply:
        request = json.loads(body)
        await asyncio.sleep(request.get("delay", 0))
        if request.get("boom"):
            raise RuntimeError("a bug in a handler")
        if "events" in request:
            return StreamReply(self._events(request["events"], request.get("pause", 0)))
        return json_reply({"path": path, "body": request, "authorization": authorization})

    async def _events(self, count: int, pause: float) -> AsyncIterator[str]:
        try:
            for i in range(count):
                yield f"data: {i}\n\n"
                await asyncio.sleep(pause)
        finally:
            self.streams_closed += 1


class Server:
    """uvicorn with the coordinator's protocol in a thread; the ASGI app behind it serves
    ``GET /ping`` and, as ``api_server.build_app`` does, the generation POSTs that the protocol
    leaves to ASGI (those pipelined behind another request)."""

    def __init__(self, routes: EchoRoutes, limits: RequestLimits, root_path: str = "") -> None:
        fastapi = FastAPI()

        @fastapi.get("/ping")
        async def ping() -> dict[str, str]:
            return {"from": "asgi"}

        async def over_asgi(request: Request) -> Response:
            reply = await routes.serve(request.url.path, await request.body(), None)
            return reply_response(reply)

        app = ApiFront(fastapi, ApiKeys([]), {GENERATION: over_asgi})

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        config = uvicorn_config(
            app, "127.0.0.1", self.port, limits, 5.0, routes=routes, root_path=root_path
        )
        self.uvicorn = uvicorn.Server(config)
        self.thread = threading.Thread(target=lambda: asyncio.run(self.uvicorn.serve()))

    def __enter__(self) -> Server:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.uvicorn.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(timeout=30)

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=30)


@pytest.fixture
def routes() -> EchoRoutes:
    return EchoRoutes()


@pytest.fixture
def server(routes: EchoRoutes) -> Iterator[Server]:
    limits = RequestLimits(max_request_body_bytes=4096, body_timeout_s=1.0, header_timeout_s=1.0)
    with Server(routes, limits) as running:
        yield running


def post(body: object, path: str = GENERATION, extra: str = "", version: str = "1.1") -> bytes:
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/{version}\r\nHost: x\r\nContent-Type: application/json\r\n{extra}"
    return head.encode() + b"Content-Length: %d\r\n\r\n" % len(data) + data


class Reader:
    """Reads HTTP/1.1 responses off a socket, one at a time."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""

    def _fill(self) -> bool:
        data = self.sock.recv(65536)
        self.buffer += data
        return bool(data)

    def _until(self, marker: bytes) -> bytes:
        while marker not in self.buffer:
            assert self._fill(), f"closed before {marker!r}: {self.buffer!r}"
        found, _, self.buffer = self.buffer.partition(marker)
        return found

    def response(self) -> tuple[int, dict[str, str], bytes]:
        """Status, headers (lower-case names) and body, de-chunked; a 100 is skipped."""
        head = self._until(b"\r\n\r\n").decode()
        status_line, *lines = head.split("\r\n")
        status = int(status_line.split()[1])
        if status == 100:
            return self.response()
        headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
        if "content-length" in headers:
            length = int(headers["content-length"])
            while len(self.buffer) < length:
                assert self._fill(), "closed inside a body"
            body, self.buffer = self.buffer[:length], self.buffer[length:]
        elif headers.get("transfer-encoding") == "chunked":
            body = b""
            while (size := int(self._until(b"\r\n"), 16)) > 0:
                while len(self.buffer) < size + 2:
                    assert self._fill(), "closed inside a chunk"
                body, self.buffer = body + self.buffer[:size], self.buffer[size + 2 :]
            self._until(b"\r\n")
        else:  # HTTP/1.0: the body runs to the close
            while self._fill():
                pass
            body, self.buffer = self.buffer, b""
        return status, headers, body

    def closed(self) -> bool:
        """True once the server has closed the connection (after any bytes left)."""
        self.sock.settimeout(30)
        return not self._fill()


def test_generation_posts_are_answered_on_a_kept_alive_connection(server: Server) -> None:
    with server.connect() as sock:
        reader = Reader(sock)
        for i in range(3):
            sock.sendall(
                post({"i": i}, path=GENERATION + "?x=1", extra="Authorization: Bearer k\r\n")
            )
            status, headers, body = reader.response()
            assert status == 200 and headers["content-type"] == "application/json"
            assert "date" in headers and "connection" not in headers
            assert json.loads(body) == {
                "path": GENERATION,
                "body": {"i": i},
                "authorization": "Bearer k",
            }


def test_generation_posts_under_the_root_path_are_answered_natively(routes: EchoRoutes) -> None:
    # --root-path: the protocol serves the prefixed path itself, routed without the prefix
    # (through ASGI the echo would say the whole path); a path merely starting with the
    # prefix's letters is not under it.
    limits = RequestLimits(max_request_body_bytes=4096, body_timeout_s=1.0, header_timeout_s=1.0)
    with Server(routes, limits, root_path="/llm") as running, running.connect() as sock:
        reader = Reader(sock)
        for path in ("/llm" + GENERATION, GENERATION):
            sock.sendall(post({"i": 1}, path=path))
            status, _, body = reader.response()
            assert status == 200 and json.loads(body)["path"] == GENERATION, path
        sock.sendall(post({"i": 1}, path="/llmx" + GENERATION))
        assert reader.response()[0] == 404  # FastAPI's: no such route


def test_pipelined_requests_are_answered_in_their_order(server: Server) -> None:
    # The first is served by the protocol, the rest wait their turn (the POSTs through ASGI).
    with server.connect() as sock:
        slow_first = post({"i": 0, "delay": 0.3}) + b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n"
        sock.sendall(slow_first + post({"i": 2}) + post({"i": 3}))
        reader = Reader(sock)
        answers = [json.loads(reader.response()[2]) for _ in range(4)]
    assert [a.get("body", a) for a in answers] == [
        {"i": 0, "delay": 0.3},
        {"from": "asgi"},
        {"i": 2},
        {"i": 3},
    ]


def test_expect_100_continue_is_answered_before_the_body_is_sent(server: Server) -> None:
    with server.connect() as sock:
        data = json.dumps({"i": 1}).encode()
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
            b"Content-Length: %d\r\n\r\n" % len(data)
        )
        assert sock.recv(64).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        sock.sendall(data)
        status, _, body = Reader(sock).response()
    assert status == 200 and json.loads(body)["body"] == {"i": 1}


def test_a_chunked_request_body_is_read_whole(server: Server) -> None:
    data = json.dumps({"i": "chunked"}).encode()
    with server.connect() as sock:
        sock.sendall(HEAD_CHUNKED)
        for piece in (data[:5], data[5:]):
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        sock.sendall(b"0\r\n\r\n")
        status, _, body = Reader(sock).response()
    assert status == 200 and json.loads(body)["body"] == {"i": "chunked"}


@pytest.mark.parametrize("declared", [str(2**64 - 1), "4097"])
def test_a_declared_body_over_the_limit_gets_413_unread(server: Server, declared: str) -> None:
    with server.connect() as sock:
        sock.sendall(
            f"POST {GENERATION} HTTP/1.1\r\nHost: x\r\nContent-Length: {declared}\r\n\r\n".encode()
        )
        reader = Reader(sock)
        status, headers, body = reader.response()
        assert status == 413 and headers["connection"] == "close"
        assert json.loads(body)["error"]["code"] == "request_too_large"
        assert reader.closed()


def test_a_length_beyond_64_bits_is_a_malformed_request(server: Server) -> None:
    with server.connect() as sock:
        sock.sendall(
            f"POST {GENERATION} HTTP/1.1\r\nHost: x\r\nContent-Length: {10**30}\r\n\r\n".encode()
        )
        reader = Reader(sock)
        assert reader.response()[0] == 400  # the parser's refusal, before any route
        assert reader.closed()


def test_a_chunked_body_growing_over_the_limit_gets_413(server: Server) -> None:
    # No Content-Length: the body is counted as it arrives. Everything is sent at once (the
    # server reads all of it), so the close after the 413 cannot reset unread bytes.
    piece = b"x" * 1024
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for _ in range(5))
    with server.connect() as sock:
        sock.sendall(HEAD_CHUNKED + chunks)
        reader = Reader(sock)
        status, _, body = reader.response()
        assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
        assert reader.closed()


def test_a_body_that_stops_arriving_gets_408_and_the_connection_closes(server: Server) -> None:
    with server.connect() as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        reader = Reader(sock)
        status, _, body = reader.response()
        assert status == 408 and json.loads(body)["error"]["code"] == "request_timeout"
        assert reader.closed()


def test_a_stream_is_sent_in_chunks_and_the_connection_serves_on(server: Server) -> None:
    with server.connect() as sock:
        reader = Reader(sock)
        sock.sendall(post({"events": 3}))
        status, headers, body = reader.response()
        assert status == 200 and headers["transfer-encoding"] == "chunked"
        assert headers["content-type"] == "text/event-stream; charset=utf-8"
        assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
        sock.sendall(post({"i": 1}))
        assert json.loads(reader.response()[2])["body"] == {"i": 1}


def test_an_http_1_0_stream_runs_to_the_close(server: Server) -> None:
    with server.connect() as sock:
        sock.sendall(post({"events": 2}, version="1.0"))
        status, headers, body = Reader(sock).response()
    assert status == 200 and "transfer-encoding" not in headers
    assert headers["connection"] == "close" and body == b"data: 0\n\ndata: 1\n\n"


def test_a_client_gone_mid_stream_closes_its_events(server: Server, routes: EchoRoutes) -> None:
    with server.connect() as sock:
        sock.sendall(post({"events": 10_000, "pause": 0.01}))
        Reader(sock)._until(b"data: 0")  # the stream runs
    deadline = time.monotonic() + 30
    while routes.streams_closed == 0:  # closing the events aborts the generation
        assert time.monotonic() < deadline, "the stream's events were never closed"
        time.sleep(0.05)


def test_a_handler_that_raises_answers_500_and_the_connection_serves_on(server: Server) -> None:
    with server.connect() as sock:
        reader = Reader(sock)
        sock.sendall(post({"boom": True}))
        status, _, body = reader.response()
        assert status == 500 and json.loads(body)["error"]["type"] == "server_error"
        sock.sendall(post({"i": 2}))
        assert reader.response()[0] == 200


def test_while_the_server_closes_each_answer_closes_its_connection(
    server: Server, routes: EchoRoutes
) -> None:
    routes.is_closing = True
    for body in ({"i": 1}, {"events": 1}):
        with server.connect() as sock:
            reader = Reader(sock)
            sock.sendall(post(body))
            status, headers, _ = reader.response()
            assert status == 200 and headers["connection"] == "close"
            assert reader.closed()


def test_a_head_that_never_completes_is_cut(server: Server) -> None:
    with server.connect() as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        assert Reader(sock).closed()  # within the 1 s head timeout, not the 30 s socket one


def test_a_busy_connection_outlives_the_head_timeout(server: Server) -> None:
    # Requests arrive whole, one after another, for three times the 1 s head timeout: the
    # deadline is on each head, never on the connection.
    with server.connect() as sock:
        reader = Reader(sock)
        started = time.monotonic()
        while time.monotonic() - started < 3.0:
            sock.sendall(post({"i": 1}))
            assert reader.response()[0] == 200
            time.sleep(0.05)


@pytest.mark.parametrize(
    "head",
    [
        b"POST /v1/completions?" + b"a" * 1_000_000 + b" HTTP/1.1\r\n\r\n",  # a long URL
        b"POST /v1/completions HTTP/1.1\r\nX-a: " + b"b" * 50_000_000 + b"\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\n" + b"X-a: b\r\n" * 2_000_000 + b"\r\n",
    ],
    ids=["url", "one-header", "many-headers"],
)
def test_an_absurd_head_gets_431_and_the_server_serves_on(routes: EchoRoutes, head: bytes) -> None:
    # A head deadline long enough for the whole head to arrive: the bound must stop it, not
    # the deadline. Without the bound each of these is read whole and answered (uvicorn keeps
    # every header it is given: the many headers took 245 MB of the server's memory).
    limits = RequestLimits(header_timeout_s=60.0)
    with Server(routes, limits) as server, server.connect() as sock:
        try:
            sock.sendall(head)
            reply = sock.recv(64)
        except OSError:  # the server stopped reading at the bound and closed: a reset
            reply = b""
        assert not reply or reply.startswith(b"HTTP/1.1 431 ")
        with server.connect() as again:
            again.sendall(post({"i": 1}))
            assert Reader(again).response()[0] == 200
