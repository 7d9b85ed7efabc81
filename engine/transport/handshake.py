"""The start-up handshake between a rank and the side that binds the sockets and serves it.

    rank (DEALER, identity = rank)            server (ROUTER, binds)
      HELLO {rank, version, pid, hash}  ->
                                        <-    INIT {input address, output address}
      (load the model, allocate the KV cache, warm up)
      ReadyResponse on the input DEALER ->    (read on the input ROUTER)
      READY                             ->

There is no start-up deadline on the server: loading can take many minutes. Instead the server
watches the rank's process and fails at once, with the exit code, if it dies.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import zmq
import zmq.utils.monitor

from corefleet.engine.messages import (
    PROTOCOL_VERSION,
    HandshakeMessage,
    Hello,
    Init,
    Ready,
    ReadyResponse,
    Refused,
)
from corefleet.engine.transport.sockets import CurveKeys, make_socket

logger = logging.getLogger(__name__)

_encoder = msgspec.msgpack.Encoder()
_handshake_decoder = msgspec.msgpack.Decoder(HandshakeMessage)
_ready_decoder = msgspec.msgpack.Decoder(ReadyResponse)

INIT_TIMEOUT_S = 300.0  # a rank gives up if nobody answers its HELLO for this long
PROGRESS_LOG_INTERVAL_S = 10.0
# How long a rank waits on the socket between checks of ``should_stop``: it bounds how late a
# SIGTERM or a parent's death is noticed while the rank waits for INIT.
_WAIT_POLL_MS = 100


class EngineStartupError(RuntimeError):
    """A rank could not start: it died, or it was refused. The message names rank and cause."""


class HandshakeCancelled(Exception):
    """``connect_handshake`` stopped waiting for INIT because its ``should_stop`` said so."""


def rank_identity(rank: int) -> bytes:
    """A rank's ZMQ identity on every DEALER: the rank as 2 bytes, little endian."""
    return rank.to_bytes(2, "little")


# ------------------------------------------------------------------------------ rank side


def connect_handshake(
    ctx: zmq.Context,
    address: str,
    hello: Hello,
    curve: CurveKeys | None,
    timeout_s: float = INIT_TIMEOUT_S,
    should_stop: Callable[[], bool] | None = None,
) -> tuple[zmq.Socket, Init]:
    """Send HELLO and wait for INIT; returns the socket (for READY) and the addresses.

    ``should_stop`` is asked every 100 ms while waiting; once it returns True the wait ends with
    :class:`HandshakeCancelled` (the socket closed). EngineStartupError: refused, or no INIT
    within ``timeout_s``.
    """
    sock = make_socket(
        ctx,
        zmq.DEALER,
        address,
        bind=False,
        identity=rank_identity(hello.rank),
        curve=curve,
        linger_ms=5000,
    )
    # Failed security handshakes are otherwise silent (ZMQ just retries): watch for them.
    monitor = sock.get_monitor_socket(_HANDSHAKE_FAILURES)
    sock.send(_encoder.encode(hello))
    logger.info("rank %d: HELLO sent to %s, waiting for INIT", hello.rank, address)
    try:
        _wait_for_reply(sock, monitor, address, hello.rank, timeout_s, should_stop)
    except BaseException:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
        raise
    sock.disable_monitor()
    monitor.close(linger=0)
    message = _handshake_decoder.decode(sock.recv())
    if isinstance(message, Refused):
        sock.close()
        raise EngineStartupError(f"rank {hello.rank} refused by {address}: {message.reason}")
    if not isinstance(message, Init):
        sock.close()
        raise EngineStartupError(f"rank {hello.rank}: expected INIT, got {message!r}")
    return sock, message


_HANDSHAKE_FAILURES = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


def _wait_for_reply(
    sock: zmq.Socket,
    monitor: zmq.Socket,
    address: str,
    rank: int,
    timeout_s: float,
    should_stop: Callable[[], bool] | None,
) -> None:
    started = last_log = time.monotonic()
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    while True:
        if should_stop is not None and should_stop():
            raise HandshakeCancelled(f"rank {rank}: stopped waiting for INIT from {address}")
        events = dict(poller.poll(_WAIT_POLL_MS))
        if sock in events:
            return
        if monitor in events:
            event = zmq.utils.monitor.recv_monitor_message(monitor)
            logger.error(
                "rank %d: security handshake with %s failed (%s): check the CURVE keys "
                "(COREFLEET_CURVE_* or --curve-keys-dir) on both sides",
                rank,
                address,
                zmq.Event(event["event"]).name,
            )
        now = time.monotonic()
        if now - started > timeout_s:
            raise EngineStartupError(f"rank {rank}: no INIT from {address} in {timeout_s} s")
        if now - last_log >= PROGRESS_LOG_INTERVAL_S:
            logger.info("rank %d: still waiting for INIT from %s", rank, address)
            last_log = now


def send_ready(sock: zmq.Socket, rank: int) -> None:
    sock.send(_encoder.encode(Ready(rank=rank)))
    sock.close()


# ------------------------------------------------------------------------------ server side


@dataclass
class _Progress:
    stage: str = "starting the process"
    hello: Hello | None = None
    ready: bool = False
    response: ReadyResponse | None = None


class HandshakeServer:
    """Serves the handshake of locally spawned ranks over already-bound sockets.

    ``handshake`` is the ROUTER ranks say HELLO/READY on, ``inputs`` the input ROUTER where their
    ReadyResponse arrives; ``init`` is what every rank is told.
    """

    def __init__(
        self,
        handshake: zmq.Socket,
        inputs: zmq.Socket,
        input_address: str,
        output_address: str,
    ) -> None:
        self.handshake = handshake
        self.inputs = inputs
        self.input_address = input_address
        self.output_address = output_address

    def wait_for_engine(self, rank: int, proc: subprocess.Popen[bytes]) -> ReadyResponse:
        """Run rank ``rank``'s handshake to the end, or raise EngineStartupError at its death."""
        progress = _Progress()
        started = last_log = time.monotonic()
        poller = zmq.Poller()
        poller.register(self.handshake, zmq.POLLIN)
        poller.register(self.inputs, zmq.POLLIN)
        while not (progress.ready and progress.response is not None):
            events = dict(poller.poll(100))
            if self.handshake in events:
                self._on_handshake(rank, self.handshake.recv_multipart(), progress)
            if self.inputs in events:
                self._on_input(rank, self.inputs.recv_multipart(), progress)
            code = proc.poll()
            if code is not None:
                raise EngineStartupError(
                    f"engine core rank {rank} (pid {proc.pid}) {describe_exit(code)} while "
                    f"{progress.stage}; its log above has the cause"
                )
            now = time.monotonic()
            if now - last_log >= PROGRESS_LOG_INTERVAL_S:
                logger.info(
                    "waiting for engine core rank %d (pid %d): %s for %.0f s",
                    rank,
                    proc.pid,
                    progress.stage,
                    now - started,
                )
                last_log = now
        assert progress.response is not None
        logger.info("engine core rank %d ready in %.1f s", rank, time.monotonic() - started)
        return progress.response

    def _on_handshake(self, rank: int, frames: list[bytes], progress: _Progress) -> None:
        if len(frames) != 2:
            logger.warning("dropped a malformed handshake message (%d frames)", len(frames))
            return
        identity, payload = frames
        try:
            message = _handshake_decoder.decode(payload)
        except msgspec.MsgspecError as exc:
            logger.warning("dropped an undecodable handshake message: %s", exc)
            return
        if identity != rank_identity(rank) or getattr(message, "rank", rank) != rank:
            logger.warning("dropped a handshake message from an unexpected rank: %r", message)
            return
        if isinstance(message, Hello) and progress.hello is None:
            if message.protocol_version != PROTOCOL_VERSION:
                reason = (
                    f"protocol version {message.protocol_version} != {PROTOCOL_VERSION}: "
                    "run the same corefleet version on both sides"
                )
                self.handshake.send_multipart([identity, _encoder.encode(Refused(reason))])
                raise EngineStartupError(f"engine core rank {rank} refused: {reason}")
            progress.hello = message
            progress.stage = "loading the model and allocating the KV cache"
            init = Init(self.input_address, self.output_address, engine_index=rank)
            self.handshake.send_multipart([identity, _encoder.encode(init)])
        elif isinstance(message, Ready) and progress.hello is not None:
            progress.ready = True
            progress.stage = "sending its ready response"
        else:
            logger.warning("dropped an out-of-order handshake message: %r", message)

    def _on_input(self, rank: int, frames: list[bytes], progress: _Progress) -> None:
        if len(frames) != 2 or frames[0] != rank_identity(rank) or progress.hello is None:
            logger.warning("dropped an unexpected message on the input socket during start-up")
            return
        try:
            progress.response = _ready_decoder.decode(frames[1])
        except msgspec.MsgspecError as exc:
            logger.warning("dropped an undecodable ready response: %s", exc)


def describe_exit(code: int) -> str:
    """``exited with code 3`` or ``was killed by SIGKILL`` (Popen's negative codes)."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name} (exit code {code})"
    return f"exited with code {code}"


def own_hello(rank: int, config_hash: str, pod_name: str | None) -> Hello:
    return Hello(
        rank=rank,
        protocol_version=PROTOCOL_VERSION,
        pod_name=pod_name or "",
        pid=os.getpid(),
        config_hash=config_hash,
    )
