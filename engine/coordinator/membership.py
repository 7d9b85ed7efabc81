"""Who is in the fleet: the coordinator's record of ranks, as a pure state machine.

Membership is dynamic: ranks join at any time (HELLO → INIT → ReadyResponse → READY), leave
(they drain, then their process exits), die (ENGINE_CORE_DEAD, a closed connection, a local
child's exit, or silence past the heartbeat timeout) and rejoin. A HELLO for a rank that is
still registered replaces the old incarnation when the old one is evidently gone — declared dead
already, or the same pod restarted (same pod name) — and is refused while another live process
holds the rank. Each accepted HELLO is a new incarnation; events about an older one (a late
close of its connection, the exit of a replaced process) change nothing.

No sockets here: :class:`~corefleet.engine.coordinator.server.FleetServer` feeds the events in,
so every rule is unit-tested without processes.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field

from corefleet.engine.messages import (
    PROTOCOL_VERSION,
    EngineStats,
    Hello,
    Init,
    ReadyResponse,
    Refused,
)

logger = logging.getLogger(__name__)


class RankState(enum.Enum):
    HANDSHAKING = "handshaking"  # HELLO answered; loading, allocating, warming up
    READY = "ready"  # serving
    DRAINING = "draining"  # finishing what it holds; takes nothing new
    DEAD = "dead"  # gone; its requests must be migrated


@dataclass
class RankMember:
    """One incarnation of one rank (a process that said HELLO)."""

    rank: int
    pod_name: str
    pid: int
    config_hash: str
    incarnation: int  # counts every accepted HELLO across the fleet, so restarts are visible
    state: RankState = RankState.HANDSHAKING
    info: ReadyResponse | None = None
    stats: EngineStats | None = None
    last_heard: float = 0.0
    ready_sent: bool = False  # READY arrived on the handshake socket
    dead_reason: str = ""

    @property
    def accepting(self) -> bool:
        return self.state is RankState.READY


@dataclass
class Membership:
    """The ranks the coordinator knows, keyed by rank number.

    ``input_address``/``output_address`` are what INIT tells ranks (the advertised addresses,
    not the bind addresses: a Service IP cannot be bound, a pod IP can).
    """

    input_address: str
    output_address: str
    heartbeat_timeout_s: float = 10.0
    members: dict[int, RankMember] = field(default_factory=dict)
    _incarnations: int = 0

    # ---- handshake ---------------------------------------------------------------------------

    def on_hello(self, hello: Hello, now: float) -> Init | Refused:
        """Register (or re-register) a rank; the reply goes back on the handshake socket."""
        if hello.protocol_version != PROTOCOL_VERSION:
            return Refused(
                f"protocol version {hello.protocol_version} != {PROTOCOL_VERSION}: run the same "
                "corefleet version on the coordinator and the ranks"
            )
        old = self.members.get(hello.rank)
        if old is not None and old.state is not RankState.DEAD:
            if old.pod_name and old.pod_name != hello.pod_name:
                return Refused(
                    f"rank {hello.rank} is held by pod {old.pod_name!r} (pid {old.pid}), "
                    "which is alive; each rank must run in one pod"
                )
            # The same pod said HELLO again: a new process (a container restart), or the same
            # one after losing its connection. Either way the old session's requests moved.
            again = old.pid == hello.pid
            reason = "handshaking again" if again else "replaced by a new process of the same pod"
            self.declare_dead(hello.rank, reason, clean=again)
        self._incarnations += 1
        self.members[hello.rank] = RankMember(
            rank=hello.rank,
            pod_name=hello.pod_name,
            pid=hello.pid,
            config_hash=hello.config_hash,
            incarnation=self._incarnations,
            last_heard=now,
        )
        mismatched = {
            m.rank for m in self.live() if m.config_hash and m.config_hash != hello.config_hash
        }
        if mismatched and hello.config_hash:
            logger.warning(
                "rank %d runs engine settings %s unlike ranks %s (a rollout in progress?)",
                hello.rank,
                hello.config_hash,
                sorted(mismatched),
            )
        logger.info("rank %d (pod %s, pid %d) joined", hello.rank, hello.pod_name, hello.pid)
        return Init(self.input_address, self.output_address, engine_index=hello.rank)

    def on_ready_response(self, rank: int, response: ReadyResponse, now: float) -> None:
        member = self._handshaking(rank)
        if member is not None:
            member.info = response
            member.last_heard = now
            self._maybe_ready(member)

    def on_ready(self, rank: int, now: float) -> None:
        member = self._handshaking(rank)
        if member is not None:
            member.ready_sent = True
            member.last_heard = now
            self._maybe_ready(member)

    def _handshaking(self, rank: int) -> RankMember | None:
        member = self.members.get(rank)
        if member is None or member.state is not RankState.HANDSHAKING:
            logger.warning("ignored a start-up message from rank %d, which is not starting", rank)
            return None
        return member

    def _maybe_ready(self, member: RankMember) -> None:
        # Both halves are needed: READY says the rank finished, the ReadyResponse (which the
        # input ROUTER must receive before it can address the rank) says what it serves.
        if member.ready_sent and member.info is not None:
            member.state = RankState.READY
            logger.info("rank %d ready: %s", member.rank, member.info)

    # ---- liveness ----------------------------------------------------------------------------

    def on_stats(self, rank: int, stats: EngineStats | None, now: float) -> None:
        """Any message from a rank proves it alive; stats also say whether it drains."""
        member = self.members.get(rank)
        if member is None or member.state is RankState.DEAD:
            return
        member.last_heard = now
        if stats is None:
            return
        member.stats = stats
        if stats.draining and member.state is RankState.READY:
            member.state = RankState.DRAINING
            logger.info("rank %d is draining", rank)

    def declare_dead(self, rank: int, reason: str, clean: bool = False) -> RankMember | None:
        """Mark a rank dead (idempotent); returns it if it was alive until now. ``clean``: it
        left on purpose (a drained shutdown), which is not worth a warning."""
        member = self.members.get(rank)
        if member is None or member.state is RankState.DEAD:
            return None
        member.state = RankState.DEAD
        member.dead_reason = reason
        level = logging.INFO if clean else logging.WARNING
        logger.log(level, "rank %d (pod %s) is gone: %s", rank, member.pod_name, reason)
        return member

    def on_disconnected(self, rank: int, incarnation: int, *, handshake: bool) -> RankMember | None:
        """One of a rank's TCP connections closed: its process died (or the network dropped it).

        Returns the rank if that made it dead. A connection of an older incarnation says nothing
        about the current one; nor does the handshake connection closing after READY (ranks
        close it then on purpose).
        """
        member = self.members.get(rank)
        if member is None or member.incarnation != incarnation or member.state is RankState.DEAD:
            return None
        if handshake and member.ready_sent:
            return None
        if member.state is RankState.DRAINING:
            # Leaving as planned: its "exiting" stats may still be unread on the output socket.
            return self.declare_dead(rank, "left (drained, then closed its connection)", True)
        if handshake:
            reason = "its handshake connection closed while it was starting (process exited)"
        else:
            reason = "its connection closed (process exited, or the network dropped it)"
        return self.declare_dead(rank, reason)

    def on_process_exited(self, rank: int, pid: int, how: str) -> RankMember | None:
        """A local rank's process ``pid`` ended (``how``: its exit code or signal).

        Returns the rank if that made it dead; a process that never said HELLO, or that a newer
        process already replaced, changes nothing.
        """
        member = self.members.get(rank)
        if member is None or member.pid != pid:
            return None
        return self.declare_dead(rank, f"its process {how}")

    def expire(self, now: float) -> list[RankMember]:
        """Declare dead every serving rank silent for longer than the heartbeat timeout.

        A rank still starting sends nothing while it loads (that can take many minutes), so
        it is never expired: it stays pending until it is ready or a new HELLO replaces it.
        """
        silent = [
            m
            for m in self.live()
            if m.state is not RankState.HANDSHAKING
            and now - m.last_heard > self.heartbeat_timeout_s
        ]
        for member in silent:
            self.declare_dead(
                member.rank, f"no message for {now - member.last_heard:.1f} s (heartbeat lost)"
            )
        return silent

    def forget(self, rank: int) -> None:
        """Drop a dead rank's record (after its requests were migrated)."""
        member = self.members.get(rank)
        if member is not None and member.state is RankState.DEAD:
            del self.members[rank]

    # ---- queries -------------------------------------------------------------------------------

    def live(self) -> list[RankMember]:
        return [m for m in self.members.values() if m.state is not RankState.DEAD]

    def accepting(self) -> list[RankMember]:
        return [m for m in self.members.values() if m.accepting]

    def counts(self) -> dict[str, int]:
        """Ranks per state, for metrics and ``/ready``."""
        counts = {state.value: 0 for state in RankState}
        for member in self.members.values():
            counts[member.state.value] += 1
        return counts
