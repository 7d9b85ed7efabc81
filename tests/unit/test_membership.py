"""The coordinator's membership rules, event by event (no sockets)."""

from __future__ import annotations

import pytest

from corefleet.engine.coordinator.membership import Membership, RankState
from corefleet.engine.messages import (
    PROTOCOL_VERSION,
    EngineStats,
    Hello,
    Init,
    ReadyResponse,
    Refused,
)


def _hello(rank: int, pod: str = "", pid: int = 100, version: int = PROTOCOL_VERSION) -> Hello:
    return Hello(rank=rank, protocol_version=version, pod_name=pod, pid=pid, config_hash="h")


def _response(rank: int) -> ReadyResponse:
    return ReadyResponse(rank, 256, 100, 16, 1584, 320, "m")


def _join(m: Membership, rank: int, pod: str = "", pid: int = 100, now: float = 0.0) -> None:
    assert isinstance(m.on_hello(_hello(rank, pod, pid), now), Init)
    m.on_ready_response(rank, _response(rank), now)
    m.on_ready(rank, now)


@pytest.fixture
def m() -> Membership:
    return Membership("tcp://10.0.0.1:5571", "tcp://10.0.0.1:5572", heartbeat_timeout_s=10.0)


def test_a_rank_is_ready_only_after_both_ready_response_and_ready(m: Membership) -> None:
    init = m.on_hello(_hello(3), 0.0)
    assert init == Init("tcp://10.0.0.1:5571", "tcp://10.0.0.1:5572", engine_index=3)
    assert m.members[3].state is RankState.HANDSHAKING
    m.on_ready(3, 1.0)
    assert m.members[3].state is RankState.HANDSHAKING and not m.accepting()
    m.on_ready_response(3, _response(3), 1.0)
    assert m.members[3].state is RankState.READY
    assert [r.rank for r in m.accepting()] == [3]


def test_a_different_protocol_version_is_refused(m: Membership) -> None:
    reply = m.on_hello(_hello(0, version=PROTOCOL_VERSION + 1), 0.0)
    assert isinstance(reply, Refused) and "protocol version" in reply.reason
    assert not m.members


def test_draining_stats_stop_routing_and_silence_declares_death(m: Membership) -> None:
    _join(m, 0)
    _join(m, 1)
    m.on_stats(1, EngineStats(rank=1, draining=True), 1.0)
    assert m.members[1].state is RankState.DRAINING
    assert [r.rank for r in m.accepting()] == [0]
    m.on_stats(0, EngineStats(rank=0), 9.0)
    dead = m.expire(12.0)  # rank 1 silent since 1.0, rank 0 heard at 9.0
    assert [r.rank for r in dead] == [1]
    assert m.members[1].state is RankState.DEAD and "heartbeat" in m.members[1].dead_reason
    assert m.members[0].state is RankState.READY
    assert m.expire(12.0) == []  # death is declared once


def test_a_dead_rank_rejoins_as_a_new_incarnation(m: Membership) -> None:
    _join(m, 0, pod="p-0", pid=1)
    first = m.members[0].incarnation
    m.declare_dead(0, "ENGINE_CORE_DEAD")
    _join(m, 0, pod="p-0", pid=2, now=5.0)
    assert m.members[0].state is RankState.READY
    assert m.members[0].pid == 2 and m.members[0].incarnation > first


def test_the_same_pod_restarting_replaces_its_live_previous_process(m: Membership) -> None:
    _join(m, 0, pod="p-0", pid=1)
    old = m.members[0]
    assert isinstance(m.on_hello(_hello(0, pod="p-0", pid=2), 1.0), Init)
    assert old.state is RankState.DEAD and "replaced" in old.dead_reason
    assert m.members[0].pid == 2 and m.members[0].state is RankState.HANDSHAKING


def test_another_pod_cannot_take_a_live_rank(m: Membership) -> None:
    _join(m, 0, pod="p-0", pid=1)
    reply = m.on_hello(_hello(0, pod="intruder", pid=9), 1.0)
    assert isinstance(reply, Refused) and "p-0" in reply.reason
    assert m.members[0].pod_name == "p-0" and m.members[0].state is RankState.READY


def test_start_up_messages_for_unknown_or_ready_ranks_change_nothing(m: Membership) -> None:
    m.on_ready(7, 0.0)
    m.on_ready_response(7, _response(7), 0.0)
    assert 7 not in m.members
    _join(m, 1)
    m.on_ready(1, 2.0)  # a duplicate READY
    assert m.members[1].state is RankState.READY


def test_counts_per_state(m: Membership) -> None:
    _join(m, 0)
    _join(m, 1)
    m.on_hello(_hello(2), 0.0)
    m.declare_dead(1, "gone")
    assert m.counts() == {"handshaking": 1, "ready": 1, "draining": 0, "dead": 1}
    m.forget(1)
    assert 1 not in m.members


def test_a_rank_that_is_still_loading_is_never_expired(m: Membership) -> None:
    m.on_hello(_hello(0), 0.0)
    assert m.expire(3600.0) == []  # an hour of loading, silent: still pending
    assert m.members[0].state is RankState.HANDSHAKING
