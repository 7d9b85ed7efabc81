"""A coordinator's side of an MoE group's waves: which ranks may take requests, and the
START_DP_WAVE messages that wake idle ranks. Pure logic: it returns what to send.

The ranks of an MoE group (ranks ``0 .. dp_size - 1`` of the fleet, as their ReadyResponse
says) step together in waves (``engine_core/waves.py``); an idle rank blocks on its input and
must be woken when any rank of its group gets work. The ranks hold the truth: this is a
coordinator's *view*, a hint built from what they send, and several coordinators may each keep
one and each send the same wake-up, which the ranks ignore when they run already. Four things
wake ranks, as in vLLM's ``DPCoordinator`` plus one repair:

- **A request to an idle group** (as this coordinator believes): the ADD goes to one rank and
  START_DP_WAVE(current wave) to every rank of the group, the target too. (vLLM excludes the
  target, which starts on its own request; but a target that refuses the request, as a
  malformed or a duplicate one, would then never run while its peers wait for it.)
- **A rank's ``start_wave``** (it got a request while idle): relayed to the group's other
  ranks, whatever this coordinator believed; the ranks drop what they do not need.
- **Rank 0's ``wave_complete``** ends the wave in the view: the next request wakes the group.
- **The ranks' stats** (every 0.5 s, with their wave and whether they run it): a rank idle in
  a wave that a peer runs is woken again, at most once a second, in case a wake-up was lost
  (a coordinator that died with it, a rank that was reconnecting).

Routing: a rank of an MoE group takes requests only while every rank of its group serves
(ready, not draining): one missing rank means the group is re-forming, and its survivors are
about to exit (``worker/dp_group.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from corefleet.engine.coordinator.membership import Membership, RankMember, RankState
from corefleet.engine.messages import EngineStats, StartDPWave

REPAIR_INTERVAL_S = 1.0  # the fewest seconds between two repair wake-ups of one rank

Wakeup = tuple[int, StartDPWave]  # (rank, message)


@dataclass
class GroupView:
    """What this coordinator believes of the fleet's MoE group."""

    current_wave: int = 0
    running: bool = False
    repaired_at: dict[int, float] = field(default_factory=dict)  # rank -> last repair wake-up


class WaveTracker:
    """The wave view over ``membership`` (a fleet has at most one MoE group: ranks
    ``0 .. dp_size - 1``; ranks whose ReadyResponse says ``dp_size`` 1 are independent)."""

    def __init__(self, membership: Membership) -> None:
        self.membership = membership
        self.view = GroupView()

    def group_of(self, rank: int) -> range | None:
        """The ranks of ``rank``'s MoE group, or None for an independent rank."""
        member = self.membership.members.get(rank)
        info = member.info if member is not None else None
        if info is None or info.dp_size <= 1:
            return None
        return range(info.dp_size)

    def routable(self, member: RankMember) -> bool:
        """Whether ``member`` may take a new request: it accepts, and so does every rank of its
        group (each saying the same group size)."""
        group = self.group_of(member.rank)
        if group is None or not member.accepting:
            return member.accepting
        members = self.membership.members
        return all(
            (peer := members.get(rank)) is not None
            and peer.accepting
            and peer.info is not None
            and peer.info.dp_size == len(group)
            for rank in group
        )

    def wave_for(self, rank: int) -> int | None:
        """The wave an ADD to ``rank`` carries (None: an independent rank, no wave)."""
        return None if self.group_of(rank) is None else self.view.current_wave

    def on_routed(self, rank: int) -> list[Wakeup]:
        """A request went to ``rank``: wake its group if this coordinator believes it idle."""
        group = self.group_of(rank)
        if group is None or self.view.running:
            return []
        self.view.running = True
        return [(peer, StartDPWave(self.view.current_wave)) for peer in self._live(group)]

    def on_start_wave(self, rank: int, wave: int) -> list[Wakeup]:
        """``rank`` started ``wave`` on its own: wake the others of its group."""
        group = self.group_of(rank)
        if group is None:
            return []
        self.view.current_wave = max(self.view.current_wave, wave)
        self.view.running = True
        message = StartDPWave(wave, exclude_rank=rank)
        return [(peer, message) for peer in self._live(group) if peer != rank]

    def on_wave_complete(self, wave: int) -> None:
        """Rank 0 ended ``wave``: the group is idle in the next one."""
        if wave >= self.view.current_wave:
            self.view.current_wave = wave + 1
            self.view.running = False

    def on_stats(self, rank: int, stats: EngineStats, now: float) -> list[Wakeup]:
        """Fresh stats of ``rank``: follow its wave, and wake a peer left idle in a wave it
        runs."""
        group = self.group_of(rank)
        if group is None:
            return []
        view = self.view
        if stats.current_wave > view.current_wave:
            view.current_wave, view.running = stats.current_wave, stats.wave_running
        if not stats.wave_running:
            return []
        wakeups = []
        for peer in self._live(group):
            seen = self.membership.members[peer].stats
            if (
                peer == rank
                or seen is None
                or seen.wave_running
                or seen.current_wave > stats.current_wave
            ):
                continue  # running, or idle in a later wave (then this rank's stats are old)
            if now - view.repaired_at.get(peer, -REPAIR_INTERVAL_S) >= REPAIR_INTERVAL_S:
                view.repaired_at[peer] = now
                wakeups.append((peer, StartDPWave(stats.current_wave, exclude_rank=rank)))
        return wakeups

    def on_rank_dead(self, rank: int) -> None:
        """A rank of the group died: the group re-forms, idle, in new processes."""
        if self.group_of(rank) is not None:
            self.view.running = False

    def _live(self, group: range) -> list[int]:
        """The ranks of ``group`` that serve now (ready or draining)."""
        members = self.membership.members
        return [
            rank
            for rank in group
            if (m := members.get(rank)) is not None
            and m.info is not None
            and m.state in (RankState.READY, RankState.DRAINING)
        ]
