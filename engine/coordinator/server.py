"""The coordinator's side of the wire: three bound sockets, membership kept current, outputs out.

    handshake ROUTER (port 5570, the Service port ranks dial)   HELLO / READY in, INIT out
    input ROUTER     (port 5571, advertised in INIT)            requests out, ReadyResponse in
    output PULL      (port 5572, advertised in INIT)            outputs, stats, ENGINE_CORE_DEAD in

Ranks only connect, so the coordinator needs no list of ranks: whoever says HELLO joins. A rank
is declared dead as soon as one of its connections to the two ROUTERs closes (a socket monitor,
see ``connections.py``): a dead process's TCP connections close at once, also while it loads.
Every message from a rank counts as a heartbeat, and a rank silent past the timeout is declared
dead too: that catches what closes no connection (a hung process, a node that vanished).
Callers get two callbacks: outputs (with the rank that sent them) and rank deaths.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

import msgspec
import zmq
import zmq.asyncio

from corefleet.engine.coordinator.connections import ConnectionWatch, Peer
from corefleet.engine.coordinator.membership import Membership, RankMember
from corefleet.engine.messages import (
    ENGINE_CORE_DEAD,
    EngineCoreOutputs,
    HandshakeMessage,
    Hello,
    Ready,
    ReadyResponse,
    RequestType,
    death_message,
)
from corefleet.engine.transport.handshake import rank_identity
from corefleet.engine.transport.serial import MsgpackDecoder, MsgpackEncoder
from corefleet.engine.transport.sockets import CurveKeys, make_socket, start_authenticator

logger = logging.getLogger(__name__)

OutputsCallback = Callable[[int, EngineCoreOutputs], None]
DeathCallback = Callable[[RankMember], None]
# (rank, its message carrying stats or a wave notice): the MoE groups' waves
WavesCallback = Callable[[int, EngineCoreOutputs], None]
_DECODE_ERRORS = (msgspec.MsgspecError, ValueError, TypeError)
_OUTPUT_BATCH = 64  # output messages handled per turn of the event loop


class FleetServer:
    """Binds the coordinator's sockets on ``bind_host`` and advertises ``advertise_host``."""

    def __init__(
        self,
        bind_host: str,
        advertise_host: str,
        ports: tuple[int, int, int] = (5570, 5571, 5572),
        *,
        on_outputs: OutputsCallback,
        on_rank_dead: DeathCallback,
        curve: CurveKeys | None = None,
        heartbeat_timeout_s: float = 10.0,
        watch_connections: bool = True,
        on_waves: WavesCallback | None = None,
    ) -> None:
        """``watch_connections=False`` leaves death detection to the heartbeat alone (how it
        was before; ``benchmarks/rank_death.py`` compares the two). ``on_waves`` sees every
        message with stats or a wave notice (``waves.py``)."""
        self.ctx = zmq.asyncio.Context()
        self.authenticator = start_authenticator(self.ctx, curve) if curve else None
        handshake_port, input_port, output_port = ports

        def bind(kind: int, port: int) -> zmq.asyncio.Socket:
            address = f"tcp://{bind_host}:{port}"
            # An asyncio context makes asyncio sockets; make_socket is typed for the sync ones.
            return cast(
                zmq.asyncio.Socket, make_socket(self.ctx, kind, address, bind=True, curve=curve)
            )

        self.handshake = bind(zmq.ROUTER, handshake_port)
        self.inputs = bind(zmq.ROUTER, input_port)
        # Outputs are read in the event loop's reader callback (``_read_outputs``), so the
        # output socket is a plain one: an asyncio socket would register a reader of its own.
        self._sync_ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.shadow(self.ctx.underlying)
        output_address = f"tcp://{bind_host}:{output_port}"
        self.outputs = make_socket(self._sync_ctx, zmq.PULL, output_address, bind=True, curve=curve)
        self.inputs.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone rank must fail loudly
        # A rank that handshakes again may connect its new input DEALER before the coordinator
        # saw the old connection close (a half-open one lasts until ZMQ's heartbeat times out):
        # the new connection must take the identity over, not be ignored. The old one's close
        # then names an older incarnation, which membership disregards.
        self.inputs.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.ports = tuple(_port(s) for s in (self.handshake, self.inputs, self.outputs))
        self.membership = Membership(
            input_address=f"tcp://{advertise_host}:{self.ports[1]}",
            output_address=f"tcp://{advertise_host}:{self.ports[2]}",
            heartbeat_timeout_s=heartbeat_timeout_s,
        )
        self.on_outputs = on_outputs
        self.on_rank_dead = on_rank_dead
        self.on_waves = on_waves
        self._encoder = MsgpackEncoder()
        self._handshake_decoder = msgspec.msgpack.Decoder(HandshakeMessage)
        self._ready_decoder = MsgpackDecoder(ReadyResponse)
        self._outputs_decoder = MsgpackDecoder(EngineCoreOutputs)
        self._tasks: list[asyncio.Task[None]] = []
        self._output_fd = cast(int, self.outputs.getsockopt(zmq.FD))
        self._input_sender: zmq.Socket[bytes] = zmq.Socket.shadow(self.inputs.underlying)
        self._watches: dict[zmq.asyncio.Socket, ConnectionWatch] = {}
        if watch_connections:
            self._watches = {
                self.handshake: ConnectionWatch(self.handshake, "handshake"),
                self.inputs: ConnectionWatch(self.inputs, "input"),
            }

    async def start(self) -> None:
        """Start serving (in the running event loop)."""
        loops = (self._handshake_loop, self._input_loop, self._output_sweep, self._expiry_loop)
        self._tasks = [asyncio.create_task(loop()) for loop in loops]
        # Outputs are read in the loop's reader callback, not by a task awaiting each message:
        # pyzmq's asyncio socket makes a future and a task wake-up per message, which was a
        # fifth of the coordinator's CPU per streamed token.
        asyncio.get_running_loop().add_reader(self._output_fd, self._read_outputs)
        logger.info("coordinator sockets on ports %s", self.ports)

    async def send(self, rank: int, kind: RequestType, payload: Any) -> None:
        """Send one request to a rank; ``zmq.ZMQError`` if it is not connected."""
        frames = [rank_identity(rank), kind.value, *self._encoder.encode(payload)]
        try:  # high-water marks are unlimited, so a send does not block: no future needed
            self._input_sender.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            await self.inputs.send_multipart(frames, copy=False)

    def send_nowait(self, rank: int, kind: RequestType, payload: Any) -> bool:
        """Send one message now if the rank is connected; False if it was not (for hints that
        may be lost, as wave wake-ups: they are repeated)."""
        frames = [rank_identity(rank), kind.value, *self._encoder.encode(payload)]
        try:
            self._input_sender.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.ZMQError:
            return False
        return True

    def process_exited(self, rank: int, pid: int, how: str) -> None:
        """A local rank's process ended (``how``: its exit code or signal): dead at once."""
        member = self.membership.on_process_exited(rank, pid, how)
        if member is not None:
            self.on_rank_dead(member)

    async def close(self) -> None:
        asyncio.get_running_loop().remove_reader(self._output_fd)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for watch in self._watches.values():
            watch.close()
        for sock in (self.handshake, self.inputs, self.outputs):
            sock.close(linger=0)
        if self.authenticator is not None:
            self.authenticator.stop()
        self.ctx.term()

    # ---- loops -------------------------------------------------------------------------------

    async def _handshake_loop(self) -> None:
        await self._serve_router(self.handshake, self._on_handshake)

    async def _input_loop(self) -> None:
        """ReadyResponses: a rank's first message on its input DEALER."""
        await self._serve_router(self.inputs, self._on_ready_response)

    async def _serve_router(
        self,
        sock: zmq.asyncio.Socket,
        on_message: Callable[[list[zmq.Frame]], Awaitable[None]],
    ) -> None:
        """Read a ROUTER's messages and the closes of its connections, in the order
        ``ConnectionWatch`` needs: events, then every message, then judge the closes."""
        watch = self._watches.get(sock)
        reader: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)  # read by this task only
        poller = zmq.asyncio.Poller()
        poller.register(sock, zmq.POLLIN)
        if watch is not None:
            poller.register(watch.monitor, zmq.POLLIN)
        while True:
            # ZMQ wakes pollers on edges, which other tasks' sends on the socket can swallow:
            # look anyway every 100 ms, so nothing waits longer than that.
            await poller.poll(timeout=100)
            if watch is not None:
                watch.read_events()
            await _drain(reader, on_message)
            for peer in watch.take_closed() if watch is not None else ():
                self._connection_closed(peer, handshake=sock is self.handshake)

    async def _on_handshake(self, frames: list[zmq.Frame]) -> None:
        if len(frames) != 2:
            logger.warning("dropped a handshake message of %d frames", len(frames))
            return
        identity, payload = frames[0].bytes, frames[1].bytes
        try:
            message = self._handshake_decoder.decode(payload)
        except msgspec.MsgspecError as exc:
            logger.warning("dropped an undecodable handshake message: %s", exc)
            return
        rank = getattr(message, "rank", None)  # HELLO and READY carry the sender's rank
        if not isinstance(rank, int) or identity != rank_identity(rank):
            logger.warning("dropped a handshake message whose identity is not its rank")
            return
        now = time.monotonic()
        if isinstance(message, Hello):
            previous = self.membership.members.get(message.rank)
            reply = self.membership.on_hello(message, now)
            current = self.membership.members.get(message.rank)
            if previous is not None and previous is not current:
                self.on_rank_dead(previous)  # its requests must move before the new one runs
            if current is not None and current is not previous:
                self._claim(self.handshake, frames[1], current)
            await self.handshake.send_multipart([identity, msgspec.msgpack.encode(reply)])
        elif isinstance(message, Ready):
            self.membership.on_ready(message.rank, now)
        else:
            logger.warning("dropped an unexpected handshake message: %r", message)

    async def _on_ready_response(self, frames: list[zmq.Frame]) -> None:
        if len(frames) != 2:
            logger.warning("dropped an input-socket message of %d frames", len(frames))
            return
        rank = int.from_bytes(frames[0].bytes, "little")
        try:
            response = self._ready_decoder.decode(frames[1])
        except _DECODE_ERRORS as exc:
            logger.warning("dropped an undecodable ready response from rank %d: %s", rank, exc)
            return
        self.membership.on_ready_response(rank, response, time.monotonic())
        member = self.membership.members.get(rank)
        if member is not None and member.info is response:
            self._claim(self.inputs, frames[1], member)

    def _claim(self, sock: zmq.asyncio.Socket, frame: zmq.Frame, member: RankMember) -> None:
        watch = self._watches.get(sock)
        if watch is not None:
            watch.claim(frame, Peer(member.rank, member.incarnation))

    def _connection_closed(self, peer: Peer, handshake: bool) -> None:
        member = self.membership.on_disconnected(peer.rank, peer.incarnation, handshake=handshake)
        if member is not None:
            self.on_rank_dead(member)

    def _read_outputs(self) -> None:
        """Handle the output messages waiting now, at most a batch of them per call so that a
        flood of outputs cannot hold the event loop: what remains is read in the next turn.

        ZMQ's file descriptor signals edges, not levels: it stays quiet until the socket has
        been read down to EAGAIN, which is why a full batch reschedules itself."""
        if self.outputs.closed:  # a turn scheduled before close()
            return
        for _ in range(_OUTPUT_BATCH):
            try:
                frames = self.outputs.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._on_output_message(frames)
        asyncio.get_running_loop().call_soon(self._read_outputs)

    async def _output_sweep(self) -> None:
        """Read outputs every 100 ms as well, so that a missed wake-up delays nothing longer."""
        while True:
            await asyncio.sleep(0.1)
            self._read_outputs()

    def _on_output_message(self, frames: list[zmq.Frame]) -> None:
        if frames[0].bytes == ENGINE_CORE_DEAD:
            rank = int.from_bytes(frames[1].bytes, "little") if len(frames) > 1 else -1
            self._dead(rank, death_message(frames))
            return
        try:
            outputs = self._outputs_decoder.decode(frames)
        except _DECODE_ERRORS as exc:
            logger.warning("dropped an undecodable message on the output socket: %s", exc)
            return
        rank = outputs.engine_index
        self.membership.on_stats(rank, outputs.engine_stats, time.monotonic())
        if outputs.engine_stats is not None and outputs.engine_stats.exiting:
            self._dead(rank, "left (shut down)", clean=True)
        if self.on_waves is not None and (
            outputs.engine_stats is not None
            or outputs.wave_complete is not None
            or outputs.start_wave is not None
        ):
            self.on_waves(rank, outputs)
        if outputs.outputs or outputs.finished_requests or outputs.utility_output:
            self.on_outputs(rank, outputs)

    async def _expiry_loop(self) -> None:
        interval = min(1.0, self.membership.heartbeat_timeout_s / 4)
        while True:
            await asyncio.sleep(interval)
            for member in self.membership.expire(time.monotonic()):
                self.on_rank_dead(member)

    def _dead(self, rank: int, reason: str, clean: bool = False) -> None:
        member = self.membership.declare_dead(rank, reason, clean)
        if member is not None:
            self.on_rank_dead(member)


async def _drain(
    reader: zmq.Socket, on_message: Callable[[list[zmq.Frame]], Awaitable[None]]
) -> None:
    """Handle every message ``reader`` holds now."""
    while True:
        try:
            frames = reader.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return
        await on_message(frames)


def _port(sock: zmq.Socket) -> int:
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    text = endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)
    return int(text.rsplit(":", 1)[1])
