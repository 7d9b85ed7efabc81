"""`corefleet-operator` as a process: kubeconfig login, one namespace, liveness, clean SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys

import aiohttp
from operator_harness import cluster, engine_manifest, eventually, run


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _alive(url: str) -> bool:
    try:
        async with aiohttp.ClientSession() as session, session.get(url) as resp:
            return resp.status == 200
    except aiohttp.ClientError:
        return False


def test_console_script_serves_a_namespace_and_exits_cleanly(tmp_path):
    async def scenario():
        async with cluster(tmp_path / "kubeconfig") as c:
            liveness = f"http://127.0.0.1:{_free_port()}/healthz"
            command = [
                sys.executable,
                "-c",
                "from corefleet.operator.cli import cli; cli()",
                "--namespace",
                "default",
                "--standalone",
                "--liveness",
                liveness,
            ]
            env = {**os.environ, "KUBECONFIG": str(tmp_path / "kubeconfig")}
            proc = subprocess.Popen(
                command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
            try:
                await c.apply(engine_manifest(ranks=2))
                await eventually(lambda: len(c.pods()) == 2, timeout=30, what="rank pods")
                ok = False
                for _ in range(100):  # the liveness endpoint answers once kopf is up
                    ok = await _alive(liveness)
                    if ok:
                        break
                    await asyncio.sleep(0.1)
                assert ok, "liveness endpoint never answered"
            finally:
                proc.send_signal(signal.SIGTERM)
                output, _ = await asyncio.to_thread(proc.communicate, timeout=30)
            assert proc.returncode == 0, output

    run(scenario(), timeout=90)
