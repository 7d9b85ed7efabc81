"""A rank's /health and /ready across its life: loading, serving, draining (the kubelet's view)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import zmq

from corefleet.engine.engine_args import engine_argv_from_config
from corefleet.engine.handshake import HandshakeServer, rank_identity
from corefleet.engine.net import bound_address, make_socket
from corefleet.engine.protocol import EngineCoreRequest, RequestType
from corefleet.engine.serial import MsgpackEncoder
from tests.engine_proc_support import greedy, tiny_config
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


def test_health_and_readiness_follow_the_engine(tmp_path: Path) -> None:
    model = write_tiny_llama(tmp_path / "m")
    port = _free_port()
    ctx = zmq.Context()
    handshake, inputs, outputs = (
        make_socket(ctx, kind, "tcp://127.0.0.1:0", bind=True)
        for kind in (zmq.ROUTER, zmq.ROUTER, zmq.PULL)
    )
    argv = [
        sys.executable,
        *(["-P"] if sys.version_info >= (3, 11) else []),
        *("-m", "corefleet.engine.cli", "engine-core"),
        *("--coordinator", bound_address(handshake), "--rank", "3"),
        *("--health-host", "127.0.0.1", "--health-port", str(port)),
        *("--shutdown-mode", "drain", "--shutdown-timeout", "60"),
        *engine_argv_from_config(tiny_config(model)),
    ]
    proc = subprocess.Popen(argv)
    try:
        # Waiting for its INIT, the rank is alive but not ready.
        _wait_for_state(port, "starting")
        assert _get(port, "/health") == (200, {"rank": 3, "state": "starting"})
        assert _get(port, "/ready")[0] == 503
        assert _get(port, "/metrics")[0] == 404

        server = HandshakeServer(handshake, inputs, bound_address(inputs), bound_address(outputs))
        server.wait_for_engine(3, proc)
        _wait_for_state(port, "ready", timeout=5)
        assert _get(port, "/ready")[0] == 200 and _get(port, "/health")[0] == 200

        # With a long request in flight, SIGTERM drains: alive, no longer ready.
        request = EngineCoreRequest("long", [5, 6, 7], greedy(250))
        encoded = MsgpackEncoder().encode(request)
        inputs.send_multipart([rank_identity(3), RequestType.ADD.value, *encoded])
        assert outputs.poll(10_000), "the request produced no output"
        os.kill(proc.pid, signal.SIGTERM)
        _wait_for_state(port, "draining", timeout=5)
        assert _get(port, "/ready")[0] == 503 and _get(port, "/health")[0] == 200
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        for sock in (handshake, inputs, outputs):
            sock.close(linger=0)
        ctx.term()
