"""The coordinator's sockets with real rank processes: join, serve, leave, die, rejoin."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from corefleet.engine.coordinator.membership import RankMember, RankState
from corefleet.engine.coordinator.server import FleetServer
from corefleet.engine.messages import EngineCoreOutputs, EngineCoreRequest, RequestType
from tests.engine_proc_support import greedy, run_with_processes, spawn_rank, until
from tests.fixtures_models import write_tiny_llama

pytestmark = pytest.mark.slow


def test_ranks_join_serve_leave_die_and_rejoin(tmp_path: Path) -> None:
    model = write_tiny_llama(tmp_path / "m")
    finished: dict[str, tuple[int, list[int]]] = {}
    tokens: dict[str, list[int]] = {}
    deaths: list[RankMember] = []

    def on_outputs(rank: int, outputs: EngineCoreOutputs) -> None:
        for out in outputs.outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finished[out.request_id] = (rank, tokens[out.request_id])

    async def scenario(procs: list[subprocess.Popen[bytes]]) -> None:
        server = FleetServer(
            "127.0.0.1",
            "127.0.0.1",
            (0, 0, 0),
            on_outputs=on_outputs,
            on_rank_dead=deaths.append,
            heartbeat_timeout_s=2.0,
            # The heartbeat alone, as for a silent failure (test_rank_death.py covers the
            # closed connections that otherwise notice a SIGKILL at once).
            watch_connections=False,
        )
        members = server.membership.members
        await server.start()
        try:
            # Two ranks join on their own, in any order; nobody told the server about them.
            procs += [spawn_rank(model, server.ports[0], r) for r in (0, 1)]
            await until(lambda: len(server.membership.accepting()) == 2, 90, "two ranks ready")
            for rank in (0, 1):
                request = EngineCoreRequest(f"on-{rank}", [5, 6, 7], greedy(6))
                await server.send(rank, RequestType.ADD, request)
            await until(lambda: {"on-0", "on-1"} <= finished.keys(), 30, "both served")
            assert finished["on-0"][0] == 0 and finished["on-1"][0] == 1
            assert finished["on-0"][1] == finished["on-1"][1] and len(finished["on-0"][1]) == 6

            # Leave: SIGTERM drains rank 1, which says it is leaving; no heartbeat wait.
            procs[1].send_signal(signal.SIGTERM)
            await until(lambda: members[1].state is RankState.DEAD, 5, "rank 1 gone")
            assert "left" in members[1].dead_reason
            assert procs[1].wait(timeout=10) == 0

            # Die: SIGKILL rank 0; silence past the 2 s heartbeat timeout declares it dead.
            killed = time.monotonic()
            os.kill(procs[0].pid, signal.SIGKILL)
            await until(lambda: members[0].state is RankState.DEAD, 6, "rank 0 dead")
            assert time.monotonic() - killed >= 1.5 and "heartbeat" in members[0].dead_reason
            assert [d.rank for d in deaths] == [1, 0]
            assert not server.membership.accepting()

            # Rejoin: a new process for rank 0 becomes a new incarnation and serves.
            old_incarnation = members[0].incarnation
            procs.append(spawn_rank(model, server.ports[0], 0))
            await until(lambda: members[0].state is RankState.READY, 90, "rank 0 back")
            assert members[0].incarnation > old_incarnation
            await server.send(0, RequestType.ADD, EngineCoreRequest("again", [5, 6, 7], greedy(6)))
            await until(lambda: "again" in finished, 30, "served after rejoining")
            assert finished["again"][1] == finished["on-0"][1]
        finally:
            await server.close()

    run_with_processes(scenario)


def test_ranks_rejoin_a_restarted_coordinator_without_reloading(tmp_path: Path) -> None:
    model = write_tiny_llama(tmp_path / "m")
    finished: set[str] = set()

    def on_outputs(rank: int, outputs: EngineCoreOutputs) -> None:
        finished.update(o.request_id for o in outputs.outputs if o.finished)

    def server(handshake_port: int) -> FleetServer:
        return FleetServer(
            "127.0.0.1",
            "127.0.0.1",
            (handshake_port, 0, 0),
            on_outputs=on_outputs,
            on_rank_dead=lambda member: None,
        )

    async def scenario(procs: list[subprocess.Popen[bytes]]) -> None:
        first = server(0)
        await first.start()
        port = first.ports[0]
        procs += [spawn_rank(model, port, r) for r in (0, 1)]
        await until(lambda: len(first.membership.accepting()) == 2, 90, "two ranks ready")
        pids = {m.rank: m.pid for m in first.membership.members.values()}
        await first.close()  # the coordinator goes away; the ranks keep running

        # A new coordinator on the same handshake address (new input/output ports).
        second = server(port)
        await second.start()
        try:
            await until(lambda: len(second.membership.accepting()) == 2, 30, "ranks rejoined")
            assert {m.rank: m.pid for m in second.membership.members.values()} == pids
            assert all(proc.poll() is None for proc in procs)  # same processes, no reload
            for rank in (0, 1):
                request = EngineCoreRequest(f"after-{rank}", [5, 6, 7], greedy(4))
                await second.send(rank, RequestType.ADD, request)
            await until(lambda: {"after-0", "after-1"} <= finished, 30, "served after rejoin")
        finally:
            await second.close()

    run_with_processes(scenario)


def _count_dials(port: int, wanted: int, timeout: float) -> int:
    """Accept and drop connections on `port` until `wanted` came (or `timeout` passed)."""
    seen = 0
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen()
        listener.settimeout(timeout)
        while seen < wanted:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                break
            conn.close()
            seen += 1
    return seen


def test_a_rank_started_before_its_coordinator_joins_when_it_comes_up(tmp_path: Path) -> None:
    model = write_tiny_llama(tmp_path / "m")
    with socket.socket() as s:  # a port nobody listens on yet
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])

    async def scenario(procs: list[subprocess.Popen[bytes]]) -> None:
        procs.append(spawn_rank(model, port, 0))
        # The rank loads nothing yet: it dials the handshake port and keeps dialling. Seen here
        # as two connections to a bare listener that hangs up on each (no coordinator behind).
        dials = await asyncio.to_thread(_count_dials, port, 2, 60.0)
        assert dials == 2 and procs[0].poll() is None
        server = FleetServer(
            "127.0.0.1",
            "127.0.0.1",
            (port, 0, 0),
            on_outputs=lambda rank, outputs: None,
            on_rank_dead=lambda member: None,
        )
        await server.start()
        try:
            await until(lambda: len(server.membership.accepting()) == 1, 90, "rank joined")
        finally:
            await server.close()

    run_with_processes(scenario)
