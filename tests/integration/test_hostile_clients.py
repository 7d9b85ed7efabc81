"""Hostile and broken clients against a real ``corefleet serve``: every size a client controls,
at absurd values, gets a 4xx and costs no memory; load beyond the limits gets 429; idle,
slow and lying connections are cut off without starving real requests."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import psutil
import pytest

from tests.fixtures_models import write_tiny_llama
from tests.hostile_requests import ABSURD, BODY_LIMIT, CHAT, MSG, C
from tests.serve_support import serve_process

pytestmark = pytest.mark.slow

KEYS = ("key-a", "key-b")
FLAGS = (
    *("--dtype", "float32", "--kv-cache-memory", str(8 << 20), "--block-size", "4"),
    *("--max-num-seqs", "8", "--api-key", KEYS[0], "--api-key", KEYS[1]),
    *("--max-concurrent-requests-per-key", "1", "--max-request-body-bytes", str(BODY_LIMIT)),
    *("--header-timeout", "2", "--body-timeout", "2"),
)
WAIT_S = 60.0  # a generous bound on every wait: the CI machine may be loaded


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[psutil.Process, str]]:
    model = write_tiny_llama(tmp_path_factory.mktemp("tiny") / "m")
    with serve_process("--model", str(model), *FLAGS) as (proc, base):
        yield psutil.Process(proc.pid), base


@pytest.fixture(scope="module")
def server(serve: tuple[psutil.Process, str]) -> str:
    return serve[1]


def post(base: str, path: str, body: Any, key: str = KEYS[0], **kw: Any) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    return httpx.post(f"{base}{path}", content=content, headers=headers, timeout=WAIT_S, **kw)


def _send_absurd(base: str) -> None:
    for path, body, status, param in ABSURD:
        response = post(base, path, body)
        summary = f"{path} {json.dumps(body)[:80]}"
        assert response.status_code == status, f"{summary}: {response.text[:300]}"
        error = response.json()["error"]
        assert error["param"] == param, f"{summary}: {error}"


def test_every_absurd_size_gets_a_4xx_and_costs_no_memory(
    serve: tuple[psutil.Process, str],
) -> None:
    proc, server = serve
    assert post(server, C, {"prompt": "Hi", "max_tokens": 2}).status_code == 200
    _send_absurd(server)  # warm-up: the allocator settles
    settled = proc.memory_info().rss
    for _ in range(3):
        _send_absurd(server)
    growth = proc.memory_info().rss - settled
    # Unbounded, n=2^31 alone grew the coordinator by gigabytes a second.
    assert growth < 64 << 20, f"the coordinator grew by {growth >> 20} MiB"
    assert post(server, C, {"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_a_huge_content_length_is_refused_unread(server: str) -> None:
    with contextlib.closing(_connect(server)) as sock:
        sock.sendall(_head(10**12) + b"{}")
        assert _reply_head(sock).startswith(b"HTTP/1.1 413")


def _rank_pid(server: str) -> int:
    ranks = httpx.get(
        f"{server}/admin/engines", headers={"Authorization": f"Bearer {KEYS[0]}"}, timeout=WAIT_S
    ).json()
    return int(ranks[0]["pid"])


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    """The rank frozen (SIGSTOP): what it was sent stays in flight until it resumes."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _in_background(fn: Any) -> tuple[threading.Thread, list[Any]]:
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    thread.start()
    return thread, result


def _wait_until_in_flight(server: str, count: int) -> None:
    deadline = time.monotonic() + WAIT_S
    metrics = ""
    while time.monotonic() < deadline:
        metrics = httpx.get(f"{server}/metrics", timeout=WAIT_S).text
        if f"corefleet_api_completions_in_flight {count}.0" in metrics:
            return
        time.sleep(0.05)
    raise AssertionError(f"never {count} request(s) in flight:\n{metrics[-2000:]}")


def test_a_key_over_its_limit_gets_429_and_other_keys_still_run(server: str) -> None:
    body = {"prompt": "Hi", "max_tokens": 2}
    with stopped(_rank_pid(server)):
        first, first_result = _in_background(lambda: post(server, C, body, key=KEYS[0]))
        _wait_until_in_flight(server, 1)
        refused = post(server, C, body, key=KEYS[0])
        other, other_result = _in_background(lambda: post(server, C, body, key=KEYS[1]))
        _wait_until_in_flight(server, 2)
    first.join(WAIT_S)
    other.join(WAIT_S)
    assert refused.status_code == 429, refused.text
    assert refused.headers["Retry-After"] == "1"
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert first_result[0].status_code == 200 and other_result[0].status_code == 200
    assert post(server, C, body, key=KEYS[0]).status_code == 200  # the slot came back


def _connect(server: str) -> socket.socket:
    host, port = server.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=WAIT_S)
    return sock


def _closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (waits up to the socket's timeout for it)."""
    try:
        return sock.recv(65536) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def test_idle_and_slowloris_connections_are_cut_and_starve_nobody(server: str) -> None:
    idle = [_connect(server) for _ in range(500)]
    slow = _connect(server)
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    try:
        stop = threading.Event()

        def dribble() -> None:  # a header byte at a time, never finishing the head
            with contextlib.suppress(OSError):
                while not stop.wait(0.3):
                    slow.sendall(b"X")

        dribbler = threading.Thread(target=dribble, daemon=True)
        dribbler.start()
        response = post(server, C, {"prompt": "Hi", "max_tokens": 2})
        assert response.status_code == 200, response.text
        # The server closes each of them (--header-timeout 2): recv sees the end of stream.
        for sock in [*idle, slow]:
            assert _closed_by_server(sock)
        stop.set()
        dribbler.join(WAIT_S)
    finally:
        for sock in [*idle, slow]:
            sock.close()


def _head(content_length: int) -> bytes:
    return (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {KEYS[0]}\r\nContent-Length: {content_length}\r\n\r\n"
    ).encode()


def _reply_head(sock: socket.socket) -> bytes:
    reply = b""
    while b"\r\n\r\n" not in reply:
        chunk = sock.recv(65536)
        assert chunk, f"closed without an answer: {reply!r}"
        reply += chunk
    return reply


def test_a_body_that_never_completes_gets_408(server: str) -> None:
    with contextlib.closing(_connect(server)) as sock:
        sock.sendall(_head(100) + b'{"prompt": ')
        assert _reply_head(sock).startswith(b"HTTP/1.1 408")


def test_the_server_answers_after_all_of_it(server: str) -> None:
    response = post(server, CHAT, {"messages": MSG, "max_tokens": 3})
    assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"]
