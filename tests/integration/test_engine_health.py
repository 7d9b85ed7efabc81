"""A rank's /health and /ready across its life: loading, serving, draining (the kubelet's view)."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import zmq

from corefleet.engine.messages import EngineCoreOutputs, EngineCoreRequest, RequestType
from corefleet.engine.transport.handshake import rank_identity
from corefleet.engine.transport.serial import MsgpackDecoder, MsgpackEncoder
from tests.engine_proc_support import bare_engine, greedy
from tests.fixtures_models import write_tiny_llama

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(port: int, path: str) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _wait_for_state(port: int, state: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    seen = None
    while time.monotonic() < deadline:
        try:
            seen = _get(port, "/ready")[1].get("state")
        except (urllib.error.URLError, ConnectionError):
            seen = None  # not listening yet
        if seen == state:
            return
        time.sleep(0.05)
    raise TimeoutError(f"state {state!r} not reached in {timeout} s (last seen {seen!r})")


def _wait_for_tokens(outputs: zmq.Socket, timeout: float = 10.0) -> None:
    """Until a message with generated tokens arrives (stats-only messages come first)."""
    decoder = MsgpackDecoder(EngineCoreOutputs)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if outputs.poll(100) and decoder.decode(outputs.recv_multipart(copy=False)).outputs:
            return
    raise TimeoutError(f"no tokens in {timeout} s")


def test_health_and_readiness_follow_the_engine(tmp_path: Path) -> None:
    port = _free_port()
    flags = ("--rank", "3", "--health-host", "127.0.0.1", "--health-port", str(port))
    drain = ("--shutdown-mode", "drain", "--shutdown-timeout", "60")
    with bare_engine(write_tiny_llama(tmp_path / "m"), *flags, *drain) as engine:
        # Waiting for its INIT, the rank is alive but not ready.
        _wait_for_state(port, "starting")
        assert _get(port, "/health") == (200, {"rank": 3, "state": "starting"})
        assert _get(port, "/ready")[0] == 503
        assert _get(port, "/metrics")[0] == 404

        engine.serve_handshake(rank=3)
        _wait_for_state(port, "ready", timeout=5)
        assert _get(port, "/ready")[0] == 200 and _get(port, "/health")[0] == 200

        # With work in flight (seconds of it), SIGTERM drains: alive, no longer ready.
        encoder = MsgpackEncoder()
        for i in range(16):
            request = encoder.encode(EngineCoreRequest(f"long{i}", [5, 6, i], greedy(250)))
            engine.inputs.send_multipart([rank_identity(3), RequestType.ADD.value, *request])
        _wait_for_tokens(engine.outputs)
        os.kill(engine.process.pid, signal.SIGTERM)
        _wait_for_state(port, "draining", timeout=5)
        assert _get(port, "/ready")[0] == 503 and _get(port, "/health")[0] == 200
        assert engine.process.wait(timeout=30) == 0
