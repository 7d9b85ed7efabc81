"""A rank whose process dies is declared dead when its connection closes, not at the heartbeat.

Every coordinator here runs with a heartbeat timeout far longer than the test's waits, so a
death noticed within them was noticed through the closed connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio

from corefleet.engine.coordinator.membership import RankMember, RankState
from corefleet.engine.coordinator.server import FleetServer
from corefleet.engine.messages import (
    PROTOCOL_VERSION,
    EngineCoreOutputs,
    EngineCoreRequest,
    Hello,
    Init,
    Ready,
    ReadyResponse,
)
from corefleet.engine.transport.handshake import rank_identity
from tests.engine_proc_support import greedy, local_fleet, run_with_processes, spawn_rank, until
from tests.fixtures_models import write_tiny_llama

HEARTBEAT_S = 3600.0  # never the cause of a death seen in these tests
WAIT_S = 60.0


class _ProtocolRank:
    """A rank's two DEALERs, driven by hand: the protocol without a model behind it."""

    def __init__(self, ctx: zmq.asyncio.Context, handshake_port: int, rank: int) -> None:
        self.ctx, self.rank = ctx, rank
        self.handshake = self._dealer(f"tcp://127.0.0.1:{handshake_port}")
        self.inputs: zmq.asyncio.Socket | None = None
        self.input_address = ""

    def _dealer(self, address: str) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, rank_identity(self.rank))
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        return sock

    async def hello(self) -> None:
        hello = Hello(rank=self.rank, protocol_version=PROTOCOL_VERSION, pid=os.getpid())
        await self.handshake.send(msgspec.msgpack.encode(hello))
        self.input_address = msgspec.msgpack.decode(
            await self.handshake.recv(), type=Init
        ).input_address

    async def ready(self) -> None:
        # Connected only now, as a real rank does after loading.
        self.inputs = self._dealer(self.input_address)
        response = ReadyResponse(self.rank, 256, 100, 4, 396, 320, "m", pid=os.getpid())
        await self.inputs.send(msgspec.msgpack.encode(response))
        await self.handshake.send(msgspec.msgpack.encode(Ready(rank=self.rank)))
        self.handshake.close()  # as a real rank does after READY


@contextlib.asynccontextmanager
async def _server(
    deaths: list[RankMember],
) -> AsyncIterator[tuple[FleetServer, zmq.asyncio.Context]]:
    """A started FleetServer recording deaths, and a context for protocol ranks; both closed
    on leaving."""

    def on_outputs(rank: int, outputs: EngineCoreOutputs) -> None:
        pass

    server = FleetServer(
        "127.0.0.1",
        "127.0.0.1",
        (0, 0, 0),
        on_outputs=on_outputs,
        on_rank_dead=deaths.append,
        heartbeat_timeout_s=HEARTBEAT_S,
    )
    await server.start()
    ctx = zmq.asyncio.Context()
    try:
        yield server, ctx
    finally:
        await server.close()
        ctx.destroy(linger=0)


def test_an_old_connection_closing_spares_a_rank_that_handshook_again() -> None:
    async def scenario() -> None:
        deaths: list[RankMember] = []
        async with _server(deaths) as (server, ctx):
            first = _ProtocolRank(ctx, server.ports[0], 0)
            await first.hello()
            await first.ready()
            await until(lambda: server.membership.members[0].accepting, WAIT_S, "rank 0 ready")
            old = server.membership.members[0]

            # The same process says HELLO again and connects a new input DEALER while its old
            # one is still open (the new connection takes the identity over); then the old
            # connection closes: that close belongs to the replaced incarnation.
            second = _ProtocolRank(ctx, server.ports[0], 0)
            await second.hello()
            new = server.membership.members[0]
            assert new.incarnation != old.incarnation
            await second.ready()
            await until(lambda: new.accepting, WAIT_S, "the new incarnation ready")
            assert first.inputs is not None
            first.inputs.close()
            watch = server._watches[server.inputs]
            await until(
                lambda: all(p.incarnation == new.incarnation for p in watch.peers()),
                WAIT_S,
                "the old input connection closed",
            )
            assert new.state is RankState.READY
            assert [d.incarnation for d in deaths] == [old.incarnation]  # the re-HELLO only

            # The current incarnation's own connection closing is a death, at once.
            assert second.inputs is not None
            second.inputs.close()
            await until(lambda: new.state is RankState.DEAD, WAIT_S, "the new incarnation dead")
            assert "connection closed" in new.dead_reason
            assert deaths[-1] is new

    asyncio.run(scenario())


def test_a_rank_that_dies_while_starting_is_dead() -> None:
    async def scenario() -> None:
        deaths: list[RankMember] = []
        async with _server(deaths) as (server, ctx):
            loading = _ProtocolRank(ctx, server.ports[0], 2)
            await loading.hello()
            member = server.membership.members[2]
            assert member.state is RankState.HANDSHAKING
            loading.handshake.close()  # what the kernel does for a process killed while loading
            await until(lambda: member.state is RankState.DEAD, WAIT_S, "the loading rank dead")
            assert "while it was starting" in member.dead_reason
            assert deaths == [member]

    asyncio.run(scenario())


@pytest.mark.slow
def test_a_sigkilled_rank_is_dead_and_its_stream_migrates(tmp_path: Path) -> None:
    model = write_tiny_llama(tmp_path / "m")

    async def scenario(procs: list[subprocess.Popen[bytes]]) -> None:
        async with local_fleet(heartbeat_timeout_s=HEARTBEAT_S) as fleet:
            procs.extend(spawn_rank(model, fleet.server.ports[0], r) for r in (0, 1))
            await until(lambda: len(fleet.membership.accepting()) == 2, 120, "two ranks ready")
            tokens: list[int] = []
            reasons: list[str] = []

            async def stream(request_id: str) -> None:
                request = EngineCoreRequest(request_id, [5, 6, 7, 8], greedy(400))
                async for output in fleet.generate(request):
                    tokens.extend(output.new_token_ids)
                    if output.finished:
                        reasons.append(str(output.finish_reason))

            # Round robin: of two requests, one lands on rank 1; follow that one.
            tasks = [asyncio.create_task(stream(f"r{i}")) for i in range(2)]
            await until(lambda: fleet.rank_of("r1") is not None, WAIT_S, "r1 routed")
            victim = fleet.rank_of("r1")
            assert victim is not None
            state = fleet._requests["r1"]
            await until(lambda: len(state.generated) >= 3, WAIT_S, "r1 streaming")
            member = fleet.membership.members[victim]
            os.kill(procs[victim].pid, signal.SIGKILL)
            await until(lambda: member.state is RankState.DEAD, WAIT_S, "the killed rank dead")
            assert "connection closed" in member.dead_reason
            await until(lambda: fleet.rank_of("r1") == 1 - victim, WAIT_S, "r1 migrated")
            await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S * 2)
            assert reasons == ["length", "length"]
            assert fleet.counters.migrations >= 1

    run_with_processes(scenario)
