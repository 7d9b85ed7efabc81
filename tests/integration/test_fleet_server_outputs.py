"""The coordinator's output socket, read by the event loop's reader callback: a burst larger
than one turn's batch arrives whole and in order, and malformed frames in it are dropped
without losing what follows (real ZMQ sockets, a PUSH socket standing in for a rank)."""

from __future__ import annotations

import asyncio

import zmq

from corefleet.engine.coordinator.server import FleetServer
from corefleet.engine.messages import EngineCoreOutput, EngineCoreOutputs
from corefleet.engine.transport.serial import MsgpackEncoder
from tests.engine_proc_support import until

BURST = 1000  # many times the 64 messages the reader handles per turn of the loop


def test_a_burst_of_outputs_arrives_whole_and_in_order_around_malformed_frames() -> None:
    received: list[str] = []

    def on_outputs(rank: int, outputs: EngineCoreOutputs) -> None:
        received.extend(output.request_id for output in outputs.outputs)

    async def scenario() -> None:
        server = FleetServer(
            "127.0.0.1",
            "127.0.0.1",
            (0, 0, 0),
            on_outputs=on_outputs,
            on_rank_dead=lambda member: None,
            watch_connections=False,
        )
        await server.start()
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, 0)  # queue the whole burst before the loop reads any
        push.connect(f"tcp://127.0.0.1:{server.ports[2]}")
        encoder = MsgpackEncoder()
        try:
            for i in range(BURST):
                if i % 100 == 50:
                    push.send_multipart([b"\xc1 not msgpack"])
                    push.send_multipart([b"\x92", b"two frames"])
                outputs = EngineCoreOutputs(outputs=[EngineCoreOutput(f"r{i}", [i])])
                push.send_multipart(encoder.encode(outputs), copy=False)
            await until(lambda: len(received) >= BURST, 60, "every output of the burst")
            assert received == [f"r{i}" for i in range(BURST)]
            # The loop still reads: one more message after the burst arrives too.
            push.send_multipart(
                encoder.encode(EngineCoreOutputs(outputs=[EngineCoreOutput("last", [1])]))
            )
            await until(lambda: received[-1:] == ["last"], 60, "the message after the burst")
        finally:
            push.close(linger=0)
            ctx.term()
            await server.close()

    asyncio.run(scenario())
