"""One rank, several coordinators: it joins each, serves each its own requests, and outlives
any of them."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest

from corefleet.engine.coordinator.membership import RankState
from corefleet.engine.coordinator.server import FleetServer
from corefleet.engine.messages import EngineCoreOutputs, EngineCoreRequest, RequestType
from tests.engine_proc_support import greedy, run_with_processes, spawn_rank, until
from tests.fixtures_models import write_tiny_llama

pytestmark = pytest.mark.slow


class _Coordinator:
    """A FleetServer and what reached it: request id -> (rank, tokens) once finished."""

    def __init__(self, handshake_port: int = 0) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.finished: dict[str, tuple[int, list[int]]] = {}
        self.server = FleetServer(
            "127.0.0.1",
            "127.0.0.1",
            (handshake_port, 0, 0),
            on_outputs=self._on_outputs,
            on_rank_dead=lambda member: None,
        )

    def _on_outputs(self, rank: int, outputs: EngineCoreOutputs) -> None:
        for out in outputs.outputs:
            self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                self.finished[out.request_id] = (rank, self.tokens[out.request_id])

    def ready(self) -> bool:
        return len(self.server.membership.accepting()) == 1

    def pid(self) -> int:
        return self.server.membership.members[0].pid


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_a_rank_joins_every_coordinator_and_outlives_one(tmp_path: Path) -> None:
    model = write_tiny_llama(tmp_path / "m")
    late_port = _free_port()  # a third coordinator, listed but not up when the rank starts

    async def scenario(procs: list[subprocess.Popen[bytes]]) -> None:
        a, b = _Coordinator(), _Coordinator()
        await a.server.start()
        await b.server.start()
        late: _Coordinator | None = None
        try:
            spec = ",".join(f"127.0.0.1:{port}" for port in (a.server.ports[0], b.server.ports[0]))
            procs.append(spawn_rank(model, f"{spec},127.0.0.1:{late_port}", 0))
            await until(lambda: a.ready() and b.ready(), 90, "the rank joined both")
            assert a.pid() == b.pid() == procs[0].pid

            # Each coordinator gets the outputs of its own requests, and only those.
            for name, coordinator in (("from-a", a), ("from-b", b)):
                request = EngineCoreRequest(name, [5, 6, 7], greedy(6))
                await coordinator.server.send(0, RequestType.ADD, request)
            await until(lambda: "from-a" in a.finished and "from-b" in b.finished, 30, "served")
            assert "from-b" not in a.tokens and "from-a" not in b.tokens
            assert a.finished["from-a"] == b.finished["from-b"] == (0, a.finished["from-a"][1])
            assert len(a.finished["from-a"][1]) == 6
            # The rank's stats reach both, each on its own heartbeat.
            assert all(c.server.membership.members[0].stats is not None for c in (a, b))

            # A coordinator that comes up later is joined by the running rank.
            late = _Coordinator(late_port)
            await late.server.start()
            await until(late.ready, 30, "the rank joined the late coordinator")
            assert late.pid() == procs[0].pid

            # One coordinator goes away: the rank serves the others on, same process.
            await a.server.close()
            await b.server.send(
                0, RequestType.ADD, EngineCoreRequest("after", [5, 6, 7], greedy(6))
            )
            await until(lambda: "after" in b.finished, 30, "served after a left")
            assert b.server.membership.members[0].state is RankState.READY
            assert procs[0].poll() is None

            # It comes back on the same address: the rank joins it again without reloading.
            a = _Coordinator(a.server.ports[0])
            await a.server.start()
            await until(a.ready, 30, "the rank rejoined the restarted coordinator")
            assert a.pid() == procs[0].pid
            await a.server.send(0, RequestType.ADD, EngineCoreRequest("back", [5, 6, 7], greedy(6)))
            await until(lambda: "back" in a.finished, 30, "served by the restarted coordinator")
            assert a.finished["back"][1] == b.finished["after"][1]
        finally:
            for coordinator in (a, b, late):
                if coordinator is not None:
                    await coordinator.server.close()

    run_with_processes(scenario)
