"""A rank's links to its coordinators: every coordinator it finds, each served on its own.

Several coordinators can share a fleet (``corefleet serve --api-server-count N``, or a
coordinator Deployment with several replicas); none owns the ranks and they never talk to each
other. So a rank joins each of them: one input thread and one output thread per coordinator
(``io_threads.py``), each with its own sockets, like the single pair a rank had before.

- **Whose request.** A link has a client index, new for every link opened (never reused): its
  input thread stamps it on every request and utility call that arrives, whatever the sender
  wrote there, and the busy loop's outputs go back by that index (:class:`OutputRouter`). A
  coordinator thus only ever sees its own requests' outputs; outputs for a link that closed
  are dropped, as its streams ended with it.
- **Stats to all.** Each output thread sends the rank's stats to its coordinator on its own
  interval, so every coordinator routes on the rank's real load.
- **Joining.** The start waits for the first INIT (``transport/dialer.py``); once the rank is
  ready, :class:`Joiner` keeps resolving ``--coordinator`` and says HELLO to every address it
  has no link to, so coordinators that start later, or restart, are joined within a refresh.
- **Losing one.** When a link's input connection drops, the busy loop closes that link and
  drops the requests it brought (their coordinator is gone, or saw this rank go and moved
  them); the others serve on. The joiner dials the address again at once.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import zmq

from corefleet.engine.engine_core.io_threads import InputSink, InputThread, OutputItem, OutputThread
from corefleet.engine.messages import EngineStats, Init, ReadyResponse, Refused
from corefleet.engine.transport.dialer import HandshakeDialer, Reply
from corefleet.engine.transport.discovery import CoordinatorResolver
from corefleet.engine.transport.handshake import rank_identity, send_ready
from corefleet.engine.transport.sockets import CurveKeys

logger = logging.getLogger(__name__)

REFRESH_S = 2.0  # how often a ready rank resolves --coordinator again
REFUSED_RETRY_S = 30.0  # a coordinator that refused this rank is asked again after this
# The client index of outputs every coordinator must see (an MoE group's wave notices).
EVERY_COORDINATOR = -1


class OutputRouter:
    """The busy loop's output queue: an output to the link of its client index (each link to
    its own copy for :data:`EVERY_COORDINATOR`), a marker (stats now, engine dead, stop) to
    every link."""

    def __init__(self) -> None:
        self._queues: dict[int, queue.SimpleQueue[OutputItem]] = {}

    def put_nowait(self, item: OutputItem) -> None:
        if isinstance(item, tuple) and item[0] == EVERY_COORDINATOR:
            # A copy each (its own list too): every output thread stamps its own stats into
            # what it sends, and merges later outputs into it.
            outputs = item[1]
            for index, each in list(self._queues.items()):
                copy = msgspec.structs.replace(outputs, outputs=list(outputs.outputs))
                each.put_nowait((index, copy))
            return
        if isinstance(item, tuple):
            link_queue = self._queues.get(item[0])
            if link_queue is not None:  # else its coordinator is gone, and its streams with it
                link_queue.put_nowait(item)
            return
        for link_queue in list(self._queues.values()):
            link_queue.put_nowait(item)

    def add(self, index: int, link_queue: queue.SimpleQueue[OutputItem]) -> None:
        self._queues[index] = link_queue

    def remove(self, index: int) -> None:
        self._queues.pop(index, None)


@dataclass(frozen=True)
class LinkSettings:
    """What every link of one rank shares."""

    rank: int
    curve: CurveKeys | None
    ready_response: Callable[[], ReadyResponse]
    make_stats: Callable[[], EngineStats]
    stats_interval_s: float


@dataclass
class CoordinatorLink:
    """One coordinator this rank serves."""

    index: int  # the client index of its requests
    address: str  # its handshake address
    input_thread: InputThread
    output_thread: OutputThread


class CoordinatorLinks:
    """Every coordinator this rank serves now. Links open from the start-up thread and the
    joiner, close from the busy loop; a lock keeps the table whole."""

    def __init__(self, ctx: zmq.Context, engine: InputSink, settings: LinkSettings) -> None:
        self.ctx, self.engine, self.settings = ctx, engine, settings
        self.router = OutputRouter()
        self._links: dict[int, CoordinatorLink] = {}
        self._next_index = 0
        self._lock = threading.Lock()

    def addresses(self) -> set[str]:
        with self._lock:
            return {link.address for link in self._links.values()}

    def all(self) -> list[CoordinatorLink]:
        with self._lock:
            return list(self._links.values())

    def open(self, address: str, handshake: zmq.Socket, init: Init) -> CoordinatorLink:
        """Connect a new link's threads to the addresses INIT gave, then say READY."""
        settings = self.settings
        with self._lock:
            index = self._next_index
            self._next_index += 1
        link_queue: queue.SimpleQueue[OutputItem] = queue.SimpleQueue()
        link = CoordinatorLink(
            index,
            address,
            InputThread(
                self.ctx,
                init.input_address,
                rank_identity(settings.rank),
                settings.curve,
                settings.ready_response(),
                self.engine,
                client_index=index,
            ),
            OutputThread(
                self.ctx,
                init.output_address,
                settings.curve,
                link_queue,
                settings.make_stats,
                init.engine_index,
                settings.stats_interval_s,
            ),
        )
        self.router.add(index, link_queue)
        with self._lock:
            self._links[index] = link
        link.output_thread.start()
        link.input_thread.start()
        while not link.input_thread.ready.wait(1.0):
            if not link.input_thread.is_alive():
                self.close(index)
                handshake.close(linger=0)
                raise RuntimeError(f"the input thread for {address} died before it was ready")
        send_ready(handshake, settings.rank)
        logger.info("rank %d: serving the coordinator at %s", settings.rank, address)
        return link

    def close(self, index: int) -> CoordinatorLink | None:
        """Stop link ``index``'s threads without flushing (its coordinator is gone)."""
        with self._lock:
            link = self._links.pop(index, None)
        if link is None:
            return None
        self.router.remove(index)
        link.input_thread.stop_event.set()
        link.output_thread.abandoned = True
        link.output_thread.output_queue.put_nowait(None)
        link.input_thread.join(timeout=2.0)
        link.output_thread.join(timeout=5.0)
        return link

    def abandon(self) -> None:
        """Nobody reads the outputs any more: every link closes without flushing."""
        for link in self.all():
            link.output_thread.abandoned = True

    def stop(self) -> bool:
        """Stop every link after its queued outputs are sent; False if a thread hung."""
        links = self.all()
        for link in links:
            link.input_thread.stop_event.set()
        self.router.put_nowait(None)
        for link in links:
            link.input_thread.join(timeout=2.0)
            link.output_thread.join(timeout=5.0)
        return not any(
            link.input_thread.is_alive() or link.output_thread.is_alive() for link in links
        )

    def join_output_threads(self, timeout_s: float) -> bool:
        """Wait for every output thread to end; False if one did not within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        for link in self.all():
            link.output_thread.join(timeout=max(0.0, deadline - time.monotonic()))
        return not any(link.output_thread.is_alive() for link in self.all())


class Joiner(threading.Thread):
    """Keeps a ready rank joined to every coordinator ``--coordinator`` resolves to."""

    def __init__(
        self,
        links: CoordinatorLinks,
        dialer: HandshakeDialer,
        resolver: CoordinatorResolver,
        refresh_s: float = REFRESH_S,
    ) -> None:
        super().__init__(name="corefleet-joiner", daemon=True)
        self.links, self.dialer, self.resolver = links, dialer, resolver
        self.refresh_s = refresh_s
        self.stop_event = threading.Event()
        self._wake = threading.Event()
        self._refused_until: dict[str, float] = {}

    def wake(self) -> None:
        """Resolve and dial now (a link was lost: its coordinator may be back already)."""
        self._wake.set()

    def run(self) -> None:
        next_refresh = 0.0
        try:
            while not self.stop_event.is_set():
                now = time.monotonic()
                if now >= next_refresh or self._wake.is_set():
                    self._wake.clear()
                    self.dialer.dial(self._unjoined(now))
                    next_refresh = now + self.refresh_s
                for reply in self.dialer.poll(100):
                    self._answered(reply)
        except Exception:  # a bug here must not go unnoticed, but the links in place serve on
            logger.exception("rank %d: the joiner failed", self.links.settings.rank)
        finally:
            self.dialer.close()

    def _unjoined(self, now: float) -> list[str]:
        joined = self.links.addresses()
        return [
            address
            for address in self.resolver.resolve()
            if address not in joined and self._refused_until.get(address, 0.0) <= now
        ]

    def _answered(self, reply: Reply) -> None:
        rank = self.links.settings.rank
        if isinstance(reply.message, Refused) or reply.sock is None:
            reason = reply.message.reason if isinstance(reply.message, Refused) else "no socket"
            logger.warning(
                "rank %d: refused by %s (%s); asking again in %.0f s",
                rank,
                reply.address,
                reason,
                REFUSED_RETRY_S,
            )
            self._refused_until[reply.address] = time.monotonic() + REFUSED_RETRY_S
            return
        if self.stop_event.is_set():
            reply.sock.close(linger=0)
            return
        try:
            self.links.open(reply.address, reply.sock, reply.message)
        except (RuntimeError, zmq.ZMQError) as exc:  # dialled again at the next refresh
            logger.error("rank %d: could not serve %s: %s", rank, reply.address, exc)
