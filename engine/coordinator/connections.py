"""Which rank each TCP connection of a bound ROUTER belongs to, so a closed one names its rank.

When a rank's process dies, the kernel closes its TCP connections at once, and ZMQ's socket
monitor reports ``EVENT_DISCONNECTED`` on the coordinator's side within milliseconds; the
heartbeat timeout would take seconds. A monitor event carries the connection's file descriptor
but no ZMQ identity, so the descriptor is tied to a rank when a message arrives on it: every
received frame knows the descriptor it was read from (``zmq.SRCFD``).

A descriptor is tied to the rank *and incarnation* that spoke on it: once the same rank joined
again (a new process, or the same one handshaking again), a late disconnect of an old
connection names an incarnation that is no longer current, and membership ignores it.

File descriptors are reused, and a socket's messages and its monitor's events travel in two
queues, so the order of reading matters. libzmq queues a connection's messages before its
``DISCONNECTED`` event, and emits that event before it closes the descriptor, hence before a new
connection can reuse it. Two rules follow:

- before a descriptor is tied to a rank, every event already queued is handled: an old
  connection's close on that descriptor is never mistaken for the new one's;
- a close is judged only after the socket's messages were read to the end: the closed
  connection's last messages (a READY) count, and one that spoke only after its close was
  read is tied to its closed connection (an orphan), not left tied to a live descriptor.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import cast

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

logger = logging.getLogger(__name__)

_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED


@dataclass(frozen=True)
class Peer:
    """The rank incarnation that spoke on a connection."""

    rank: int
    incarnation: int


class ConnectionWatch:
    """Ties one bound socket's connections to ranks and reports those that closed.

    The owner polls ``monitor`` next to the socket and, on each wake-up: calls
    :meth:`read_events`, reads the socket's messages to the end (calling :meth:`claim` for
    each message that identifies its rank), then judges each peer :meth:`take_closed` returns.
    """

    def __init__(self, sock: zmq.asyncio.Socket, name: str) -> None:
        self.name = name
        self._sock = sock
        # An asyncio socket's monitor is an asyncio socket; read it without blocking through
        # its synchronous shadow, so one task can poll both and choose the order.
        self.monitor = cast(zmq.asyncio.Socket, sock.get_monitor_socket(_EVENTS))
        self._monitor_sync: zmq.Socket[bytes] = zmq.Socket.shadow(self.monitor.underlying)
        self._peers: dict[int, Peer] = {}
        self._closed: list[Peer] = []
        self._orphans: set[int] = set()  # descriptors closed before anyone spoke on them

    def read_events(self) -> None:
        """Handle every monitor event queued now, without blocking."""
        while True:
            try:
                frames = self._monitor_sync.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event = parse_monitor_message(frames)
            fd = int(event["value"])
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._orphans.discard(fd)  # what arrives on it now is the new connection's
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                peer = self._peers.pop(fd, None)
                if peer is None:
                    self._orphans.add(fd)
                else:
                    self._closed.append(peer)

    def claim(self, frame: zmq.Frame, peer: Peer) -> None:
        """The message ``frame`` came from ``peer``: its connection is that rank's."""
        self.read_events()
        fd = cast(int, frame.get(zmq.SRCFD))
        if fd in self._orphans:
            self._closed.append(peer)  # it spoke, then closed before we read its words
        elif fd >= 0:
            self._peers[fd] = peer

    def take_closed(self) -> list[Peer]:
        """The ranks whose connection closed since the last call (call it only once the
        socket's messages were read to the end)."""
        closed, self._closed = self._closed, []
        self._orphans.clear()
        for peer in closed:
            logger.debug("%s connection of rank %d closed", self.name, peer.rank)
        return closed

    def peers(self) -> list[Peer]:
        """The ranks of the connections open now that a rank spoke on (for diagnostics)."""
        return list(self._peers.values())

    def close(self) -> None:
        """Stop monitoring (before the socket closes)."""
        self._sock.disable_monitor()
        self.monitor.close(linger=0)
