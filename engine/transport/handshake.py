"""The start-up handshake between a rank and the side that binds the sockets and serves it.

    rank (DEALER, identity = rank)            server (ROUTER, binds)
      HELLO {rank, version, pid, hash}  ->
                                        <-    INIT {input address, output address}
      (load the model, allocate the KV cache, warm up)
      ReadyResponse on the input DEALER ->    (read on the input ROUTER)
      READY                             ->

There is no start-up deadline on the server: loading can take many minutes. Instead the server
watches the rank's process and fails at once, with the exit code, if it dies. A rank says HELLO
to every coordinator it finds (``dialer.py``); each runs this exchange with it on its own.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
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

logger = logging.getLogger(__name__)

_encoder = msgspec.msgpack.Encoder()
_handshake_decoder = msgspec.msgpack.Decoder(HandshakeMessage)
_ready_decoder = msgspec.msgpack.Decoder(ReadyResponse)

INIT_TIMEOUT_S = 300.0  # a rank gives up if nobody answers its HELLO for this long
PROGRESS_LOG_INTERVAL_S = 10.0


class EngineStartupError(RuntimeError):
    """A rank could not start: it died, or it was refused. The message names rank and cause."""


def rank_identity(rank: int) -> bytes:
    """A rank's ZMQ identity on every DEALER: the rank as 2 bytes, little endian."""
    return rank.to_bytes(2, "little")


# ------------------------------------------------------------------------------ rank side
# (HELLO and INIT: ``dialer.py``)


def send_ready(sock: zmq.Socket, rank: int) -> None:
    """Say READY on the socket that carried HELLO, and close it (it lingers until sent)."""
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
