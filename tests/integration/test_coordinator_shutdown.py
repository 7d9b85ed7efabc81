"""A coordinator leaving a rolling update: with ``--shutdown-delay`` it says "not ready" at once
but goes on serving, closing each connection after its response, until the delay ends or a
second signal comes; then it finishes what it holds and exits 0."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.engine_proc_support import spawn_rank
from tests.fixtures_models import write_tiny_llama
from tests.serve_support import free_port, wait_serve_ready

pytestmark = pytest.mark.slow

TIMEOUT_S = 120.0
DELAY_S = 600.0  # far longer than the test: the second SIGTERM is what ends it


def _post(conn: http.client.HTTPConnection, body: dict) -> tuple[int, str | None, bytes]:
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    return response.status, response.getheader("connection"), response.read()


def _ready_status(port: int) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
    try:
        conn.request("GET", "/ready")
        return conn.getresponse().status
    finally:
        conn.close()


def _coordinator_and_rank(
    tmp_path: Path, *flags: str
) -> tuple[subprocess.Popen[bytes], subprocess.Popen[bytes], int]:
    """``corefleet coordinator`` (with ``flags``) on loopback, one tiny rank dialling it, and
    the coordinator's HTTP port."""
    model = write_tiny_llama(tmp_path / "m")
    http_port, handshake_port = free_port(), free_port()
    argv = [
        sys.executable,
        *(["-P"] if sys.version_info >= (3, 11) else []),
        *("-m", "corefleet.engine.cli", "coordinator", "--model", str(model)),
        *("--host", "127.0.0.1", "--port", str(http_port), "--advertise-host", "127.0.0.1"),
        *("--handshake-port", str(handshake_port), "--input-port", "0", "--output-port", "0"),
        *flags,
    ]
    return subprocess.Popen(argv), spawn_rank(model, handshake_port, 0), http_port


def test_a_delayed_shutdown_serves_unready_then_stops_on_a_second_signal(tmp_path: Path) -> None:
    coordinator, rank, http_port = _coordinator_and_rank(tmp_path, "--shutdown-delay", str(DELAY_S))
    try:
        wait_serve_ready(coordinator, f"http://127.0.0.1:{http_port}", TIMEOUT_S)
        kept = http.client.HTTPConnection("127.0.0.1", http_port, timeout=TIMEOUT_S)
        short = {"prompt": "hello", "max_tokens": 4}
        status, connection, _ = _post(kept, short)
        assert (status, connection) == (200, None)  # kept alive, as usual

        coordinator.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + TIMEOUT_S
        while _ready_status(http_port) != 503:  # new connections still accepted, not ready
            assert time.monotonic() < deadline, "/ready never turned 503"
            time.sleep(0.05)
        # A client that has not noticed is served, on its kept-alive connection too, and told
        # to take its next request elsewhere.
        status, connection, body = _post(kept, short)
        assert (status, connection) == (200, "close")
        assert json.loads(body)["usage"]["completion_tokens"] == 4
        fresh = http.client.HTTPConnection("127.0.0.1", http_port, timeout=TIMEOUT_S)
        status, connection, _ = _post(fresh, {**short, "stream": True})
        assert (status, connection) == (200, "close")
        assert coordinator.poll() is None  # still there: the delay has not ended

        coordinator.send_signal(signal.SIGTERM)  # a second signal: stop now
        assert coordinator.wait(timeout=TIMEOUT_S) == 0
    finally:
        for proc in (coordinator, rank):
            proc.kill()
            proc.wait(timeout=10)


def _refuses_connections(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S).close()
    except ConnectionRefusedError:
        return True
    return False


def test_a_connection_kept_alive_across_the_stop_serves_one_more_request(tmp_path: Path) -> None:
    # A response begun before the stop says nothing of closing, so its client may reuse the
    # connection the moment it ends; closing it then would lose that request.
    coordinator, rank, http_port = _coordinator_and_rank(tmp_path)
    try:
        wait_serve_ready(coordinator, f"http://127.0.0.1:{http_port}", TIMEOUT_S)
        kept = http.client.HTTPConnection("127.0.0.1", http_port, timeout=TIMEOUT_S)
        short = {"prompt": "hello", "max_tokens": 4}
        assert _post(kept, short)[:2] == (200, None)

        coordinator.send_signal(signal.SIGTERM)  # no delay: it stops accepting at once
        deadline = time.monotonic() + TIMEOUT_S
        while not _refuses_connections(http_port):
            assert time.monotonic() < deadline, "the listening socket never closed"
            time.sleep(0.05)
        status, connection, body = _post(kept, short)
        assert (status, connection) == (200, "close")
        assert json.loads(body)["usage"]["completion_tokens"] == 4
        assert coordinator.wait(timeout=TIMEOUT_S) == 0
    finally:
        for proc in (coordinator, rank):
            proc.kill()
            proc.wait(timeout=10)


@pytest.mark.parametrize("delay", ["-1", "1e9", "nan"])
def test_an_absurd_shutdown_delay_is_refused(delay: str) -> None:
    argv = [sys.executable, "-m", "corefleet.engine.cli", "coordinator", "--shutdown-delay", delay]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 2
    assert f"--shutdown-delay {float(delay)} must be between 0 and" in done.stderr
