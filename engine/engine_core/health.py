"""The rank's HTTP health endpoints, for the kubelet's probes (port 8001 in a rank pod).

``GET /health`` is liveness: 200 while the process serves at all, loading included (a slow
model load must not get the pod restarted), 503 once the engine core has failed.
``GET /ready`` is readiness: 200 only while the engine serves requests; 503 while it starts,
drains or is gone. The body is one JSON object with the state, so a human can curl it.
"""

from __future__ import annotations

import enum
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

logger = logging.getLogger(__name__)


class EngineState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"
    STOPPED = "stopped"


_LIVE = {EngineState.STARTING, EngineState.READY, EngineState.DRAINING, EngineState.STOPPED}


class HealthServer:
    """Serves ``/health`` and ``/ready`` from a daemon thread; ``state`` is set by the engine."""

    def __init__(self, host: str, port: int, rank: int) -> None:
        self.state = EngineState.STARTING
        self.rank = rank
        health = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                status, body = health.respond(self.path)
                payload = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # probes every few seconds would drown the engine's log

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="corefleet-health", daemon=True
        )

    def respond(self, path: str) -> tuple[int, dict[str, Any]]:
        state = self.state
        body = {"rank": self.rank, "state": state.value}
        if path.split("?")[0] == "/health":
            return (200 if state in _LIVE else 503), body
        if path.split("?")[0] == "/ready":
            return (200 if state is EngineState.READY else 503), body
        return 404, {"error": f"no such endpoint {path!r}; try /health or /ready"}

    def start(self) -> HealthServer:
        self._thread.start()
        logger.info("rank %d: health endpoints on port %d", self.rank, self.port)
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
