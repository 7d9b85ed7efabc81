"""`corefleet-operator` as a process: kubeconfig login (the chart's ServiceAccount token), one
namespace, liveness, clean SIGTERM; against a real API server."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

from operator_harness import engine_manifest, eventually, run
from operator_run import operator_process
from real_cluster import real_cluster


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _alive(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def test_console_script_serves_a_namespace_and_exits_cleanly(tmp_path):
    async def scenario():
        async with real_cluster(tmp_path) as c:
            liveness = f"http://127.0.0.1:{_free_port()}/healthz"
            args = ["--namespace", "default", "--standalone", "--liveness", liveness]
            async with operator_process(c.kubeconfig, tmp_path / "op.log", *args, stop="term"):
                await c.apply(engine_manifest(ranks=2))
                await eventually(lambda: len(c.pods()) == 2, what="rank pods")
                await eventually(lambda: _alive(liveness), what="the liveness endpoint")

    run(scenario())
