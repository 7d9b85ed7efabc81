"""An MoE group's waves as pure logic: a rank's WaveState and the coordinator's WaveTracker,
driven message by message (the busy loop and the sockets are tested with real processes in
tests/integration/test_dp_group_serve.py)."""

from __future__ import annotations

import pytest

from corefleet.engine.coordinator.membership import Membership
from corefleet.engine.coordinator.waves import REPAIR_INTERVAL_S, WaveTracker
from corefleet.engine.engine_core.waves import SYNC_INTERVAL, GroupSync, WaveState
from corefleet.engine.messages import (
    MAX_WAVE,
    PROTOCOL_VERSION,
    EngineStats,
    Hello,
    ReadyResponse,
    StartDPWave,
)

# ---- a rank's wave -------------------------------------------------------------------------


def test_an_add_to_an_idle_rank_starts_the_wave_and_asks_once() -> None:
    wave = WaveState(rank=1)
    assert wave.on_request(0) == 0  # announce: the coordinators wake the others
    assert wave.running
    assert wave.on_request(0) is None  # running already: nothing to announce


def test_an_add_from_a_later_wave_is_caught_up_and_absurd_waves_are_not() -> None:
    wave = WaveState(rank=0, current_wave=3)
    assert wave.on_request(7) == 7 and wave.current_wave == 7
    late = WaveState(rank=0, current_wave=3)
    assert late.on_request(1) == 3  # an older wave: it still starts, in its own wave
    for bad in (-1, MAX_WAVE + 1):
        odd = WaveState(rank=0, current_wave=3)
        assert odd.on_request(bad) == 3


def test_start_is_idempotent_ignores_its_starter_and_late_waves() -> None:
    wave = WaveState(rank=1, current_wave=4)
    assert not wave.on_start(StartDPWave(4, exclude_rank=1))  # this rank started it itself
    assert not wave.on_start(StartDPWave(3))  # a wave that already ended here
    assert not wave.running
    assert wave.on_start(StartDPWave(4))
    assert not wave.on_start(StartDPWave(4))  # a second coordinator's copy: no change
    assert wave.running and wave.current_wave == 4
    assert not wave.on_start(StartDPWave(9)) and wave.current_wave == 9  # catches up


def test_the_sync_is_due_every_interval_and_ends_the_wave_only_when_nobody_has_work() -> None:
    wave = WaveState(rank=0)
    wave.start()
    due = [wave.count_step() for _ in range(2 * SYNC_INTERVAL)]
    assert [i + 1 for i, d in enumerate(due) if d] == [SYNC_INTERVAL, 2 * SYNC_INTERVAL]
    assert wave.on_sync(GroupSync(unfinished=True, draining=False, wave=0)) is None
    assert wave.running
    assert wave.on_sync(GroupSync(unfinished=False, draining=False, wave=2)) == 2
    assert not wave.running and wave.current_wave == 3 and wave.steps == 0


def test_group_sync_round_trips_through_its_flags() -> None:
    sync = GroupSync(unfinished=True, draining=False, wave=12)
    assert GroupSync.from_flags(sync.flags()) == sync


def _max(*syncs: GroupSync) -> GroupSync:
    """What the group's MAX all-reduce makes of the ranks' contributions."""
    columns = zip(*(s.flags() for s in syncs), strict=True)
    return GroupSync.from_flags([max(values) for values in columns])


def test_two_ranks_end_each_wave_together_with_equal_steps_and_waves() -> None:
    """Rank 0 gets a 40-step request; rank 1 is woken by the relayed start and runs dummy
    steps. They sync at the same step counts, agree on the wave, and end it together."""
    ranks = [WaveState(rank=0), WaveState(rank=1, current_wave=5)]  # numbers drifted apart
    assert ranks[0].on_request(request_wave=2) == 2
    assert ranks[1].on_start(StartDPWave(2, exclude_rank=0)) is False  # 2 < 5: late for it
    ranks[1].start()  # ...but a coordinator's repair (or its own request) starts it anyway
    work = [40, 0]  # real steps left on each rank
    steps = [0, 0]
    ended: list[int | None] = [None, None]
    while ranks[0].running or ranks[1].running:
        due = []
        for i, wave in enumerate(ranks):
            work[i] = max(0, work[i] - 1)
            steps[i] += 1
            due.append(wave.count_step())
        assert due[0] == due[1]  # the same step counts: the collectives match
        if due[0]:
            contributions = [
                GroupSync(work[i] > 0, False, wave.current_wave) for i, wave in enumerate(ranks)
            ]
            group = _max(*contributions)
            ended = [wave.on_sync(group) for wave in ranks]
    assert steps == [2 * SYNC_INTERVAL, 2 * SYNC_INTERVAL]
    assert ended == [5, 5] and [w.current_wave for w in ranks] == [6, 6]


# ---- the coordinator's view ------------------------------------------------------------------


def _member(m: Membership, rank: int, dp_size: int) -> None:
    m.on_hello(Hello(rank=rank, protocol_version=PROTOCOL_VERSION, pid=100 + rank), 0.0)
    m.on_ready_response(
        rank, ReadyResponse(rank, 256, 100, 16, 1584, 320, "m", dp_size=dp_size), 0.0
    )
    m.on_ready(rank, 0.0)


@pytest.fixture
def group() -> WaveTracker:
    m = Membership("tcp://a:1", "tcp://a:2")
    for rank in range(3):
        _member(m, rank, dp_size=3)
    return WaveTracker(m)


def test_independent_ranks_have_no_wave_and_route_alone() -> None:
    m = Membership("tcp://a:1", "tcp://a:2")
    _member(m, 0, dp_size=1)
    _member(m, 1, dp_size=1)
    waves = WaveTracker(m)
    assert waves.wave_for(0) is None and waves.on_routed(0) == []
    m.on_stats(1, EngineStats(rank=1, draining=True), 1.0)
    assert waves.routable(m.members[0]) and not waves.routable(m.members[1])


def test_a_group_takes_requests_only_while_whole(group: WaveTracker) -> None:
    m = group.membership
    assert all(group.routable(member) for member in m.members.values())
    m.declare_dead(2, "killed")
    assert not any(group.routable(member) for member in m.members.values())
    _member(m, 2, dp_size=3)  # the new process of rank 2 joined the new group
    assert all(group.routable(member) for member in m.members.values())
    m.on_stats(1, EngineStats(rank=1, draining=True), 1.0)
    assert not any(group.routable(member) for member in m.members.values())


def test_a_request_to_an_idle_group_wakes_every_rank_once(group: WaveTracker) -> None:
    assert group.wave_for(1) == 0
    wakeups = group.on_routed(1)
    assert wakeups == [(r, StartDPWave(0, exclude_rank=-1)) for r in range(3)]  # target too
    assert group.on_routed(2) == []  # believed running now
    group.on_wave_complete(0)
    assert group.wave_for(0) == 1 and group.on_routed(0) == [(r, StartDPWave(1)) for r in range(3)]


def test_a_rank_that_started_alone_is_always_relayed(group: WaveTracker) -> None:
    group.on_routed(0)  # believed running...
    relayed = group.on_start_wave(2, 4)  # ...but rank 2 says it started wave 4 on its own
    assert relayed == [(0, StartDPWave(4, exclude_rank=2)), (1, StartDPWave(4, exclude_rank=2))]
    group.on_wave_complete(3)  # a late notice of an older wave changes nothing
    assert group.wave_for(0) == 4 and group.view.running


def test_stats_repair_a_rank_left_idle_in_a_running_wave_at_most_once_a_second(
    group: WaveTracker,
) -> None:
    m = group.membership
    m.on_stats(1, EngineStats(rank=1, current_wave=2), 0.0)  # idle in wave 2
    m.on_stats(2, EngineStats(rank=2, current_wave=3), 0.0)  # idle in wave 3: ahead
    running = EngineStats(rank=0, current_wave=2, wave_running=True)
    m.on_stats(0, running, 10.0)
    assert group.on_stats(0, running, 10.0) == [(1, StartDPWave(2, exclude_rank=0))]
    assert group.on_stats(0, running, 10.0 + REPAIR_INTERVAL_S / 2) == []
    assert len(group.on_stats(0, running, 10.0 + REPAIR_INTERVAL_S)) == 1
    m.on_stats(1, EngineStats(rank=1, current_wave=2, wave_running=True), 12.0)
    assert group.on_stats(0, running, 20.0) == []  # both run it now


def test_a_death_in_the_group_makes_the_view_idle(group: WaveTracker) -> None:
    group.on_routed(0)
    group.membership.declare_dead(1, "killed")
    group.on_rank_dead(1)
    assert not group.view.running
