"""The rank's side of the handshake, with every coordinator at once.

    rank (DEALER per coordinator, identity = rank)     coordinator (ROUTER, binds)
      HELLO {rank, version, pid, hash}             ->
                                                   <-    INIT {input address, output address}
      (load the model, ... : ``handshake.py``)
      READY                                        ->

:class:`HandshakeDialer` keeps one pending HELLO per coordinator address: a DEALER that sent
HELLO and waits for the answer. ZMQ connects and reconnects by itself, so a HELLO to a
coordinator that is not up yet goes out when it comes up; a HELLO unanswered for
``RESEND_S`` is sent again on a new socket (the coordinator may have died after receiving it).
The rank's start waits for the first INIT (:func:`wait_for_first_init`); afterwards the links
thread (``engine_core/links.py``) keeps dialling the coordinators it has not joined.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import msgspec
import zmq
import zmq.utils.monitor

from corefleet.engine.messages import HandshakeMessage, Hello, Init, Refused
from corefleet.engine.transport.handshake import (
    INIT_TIMEOUT_S,
    PROGRESS_LOG_INTERVAL_S,
    EngineStartupError,
    rank_identity,
)
from corefleet.engine.transport.sockets import CurveKeys, make_socket

logger = logging.getLogger(__name__)

RESEND_S = 10.0  # a HELLO unanswered this long goes out again, on a new connection
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(HandshakeMessage)
# Failed security handshakes are otherwise silent (ZMQ just retries): watch for them.
_HANDSHAKE_FAILURES = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


@dataclass
class _Pending:
    sock: zmq.Socket
    monitor: zmq.Socket
    sent_at: float


@dataclass(frozen=True)
class Reply:
    """A coordinator's answer to our HELLO. ``sock`` (with an INIT) carries READY later."""

    address: str
    message: Init | Refused
    sock: zmq.Socket | None  # None with a Refused: the socket is closed already


class HandshakeDialer:
    """A rank's pending HELLOs, one per coordinator address; use from one thread at a time."""

    def __init__(self, ctx: zmq.Context, hello: Hello, curve: CurveKeys | None) -> None:
        self.ctx, self.hello, self.curve = ctx, hello, curve
        self._pending: dict[str, _Pending] = {}
        self._poller = zmq.Poller()

    @property
    def pending(self) -> list[str]:
        """The addresses whose answer we wait for."""
        return list(self._pending)

    def dial(self, addresses: Iterable[str]) -> None:
        """Wait for exactly these addresses: HELLO to each new one (and again to one silent
        for ``RESEND_S``); the pending HELLO of an address no longer listed is dropped."""
        wanted = list(dict.fromkeys(addresses))
        for address in [a for a in self._pending if a not in wanted]:
            self._drop(address)
        now = time.monotonic()
        for address in wanted:
            pending = self._pending.get(address)
            if pending is not None and now - pending.sent_at >= RESEND_S:
                self._drop(address)
                pending = None
            if pending is None:
                self._send_hello(address, now)

    def poll(self, timeout_ms: int) -> list[Reply]:
        """The answers that arrived within ``timeout_ms`` (at most one wait)."""
        if not self._pending:
            time.sleep(timeout_ms / 1000)
            return []
        events = dict(self._poller.poll(timeout_ms))
        replies = []
        for address, pending in list(self._pending.items()):
            if pending.monitor in events:
                self._log_security_failure(address, pending.monitor)
            if pending.sock in events:
                reply = self._read_reply(address, pending)
                if reply is not None:
                    replies.append(reply)
        return replies

    def close(self) -> None:
        for address in list(self._pending):
            self._drop(address)

    def _send_hello(self, address: str, now: float) -> None:
        sock = make_socket(
            self.ctx,
            zmq.DEALER,
            address,
            bind=False,
            identity=rank_identity(self.hello.rank),
            curve=self.curve,
            linger_ms=5000,  # READY, sent on this socket, must go out before it closes
        )
        monitor = sock.get_monitor_socket(_HANDSHAKE_FAILURES)
        sock.send(_encoder.encode(self.hello))
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(monitor, zmq.POLLIN)
        self._pending[address] = _Pending(sock, monitor, now)
        logger.debug("rank %d: HELLO sent to %s", self.hello.rank, address)

    def _read_reply(self, address: str, pending: _Pending) -> Reply | None:
        self._forget(address)
        try:
            message = _decoder.decode(pending.sock.recv())
        except msgspec.MsgspecError as exc:
            logger.warning("rank %d: undecodable answer from %s: %s", self.hello.rank, address, exc)
            pending.sock.close(linger=0)
            return None
        if isinstance(message, Refused):
            pending.sock.close(linger=0)
            return Reply(address, message, None)
        if not isinstance(message, Init):
            logger.warning("rank %d: %s answered HELLO with %r", self.hello.rank, address, message)
            pending.sock.close(linger=0)
            return None
        return Reply(address, message, pending.sock)

    def _log_security_failure(self, address: str, monitor: zmq.Socket) -> None:
        event = zmq.utils.monitor.recv_monitor_message(monitor)
        logger.error(
            "rank %d: security handshake with %s failed (%s): check the CURVE keys "
            "(COREFLEET_CURVE_* or --curve-keys-dir) on both sides",
            self.hello.rank,
            address,
            zmq.Event(event["event"]).name,
        )

    def _forget(self, address: str) -> _Pending:
        """Stop waiting on ``address``; its socket stays open (the caller decides)."""
        pending = self._pending.pop(address)
        self._poller.unregister(pending.sock)
        self._poller.unregister(pending.monitor)
        pending.sock.disable_monitor()
        pending.monitor.close(linger=0)
        return pending

    def _drop(self, address: str) -> None:
        self._forget(address).sock.close(linger=0)


def wait_for_first_init(
    dialer: HandshakeDialer,
    addresses: Callable[[], list[str]],
    timeout_s: float = INIT_TIMEOUT_S,
    refresh_s: float = 1.0,
) -> list[Reply]:
    """Dial ``addresses()`` (asked again every ``refresh_s``) until INITs arrive; returns them.

    EngineStartupError when a coordinator refuses the rank (another pod holds it, another
    protocol version) or none answers within ``timeout_s``. The HELLOs still pending stay with
    ``dialer``: their answers are taken once the rank is ready.
    """
    rank = dialer.hello.rank
    started = last_log = last_refresh = time.monotonic()
    dialer.dial(addresses())
    while True:
        replies = dialer.poll(100)
        for reply in replies:
            if isinstance(reply.message, Refused):
                for other in replies:
                    if other.sock is not None:
                        other.sock.close(linger=0)
                raise EngineStartupError(
                    f"rank {rank} refused by {reply.address}: {reply.message.reason}"
                )
        if replies:
            return replies
        now = time.monotonic()
        if now - started > timeout_s:
            raise EngineStartupError(
                f"rank {rank}: no INIT from {', '.join(dialer.pending) or 'any coordinator'} "
                f"in {timeout_s} s"
            )
        if now - last_refresh >= refresh_s:
            dialer.dial(addresses())
            last_refresh = now
        if now - last_log >= PROGRESS_LOG_INTERVAL_S:
            waiting = ", ".join(dialer.pending) or "a coordinator address (none resolves)"
            logger.info("rank %d: still waiting for INIT from %s", rank, waiting)
            last_log = now
