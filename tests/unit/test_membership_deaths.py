"""Membership's rules for deaths reported by connections and local processes (no sockets)."""

from __future__ import annotations

from corefleet.engine.coordinator.membership import Membership, RankState
from corefleet.engine.messages import PROTOCOL_VERSION, EngineStats, Hello, ReadyResponse


def _hello(rank: int, pid: int = 100) -> Hello:
    return Hello(rank=rank, protocol_version=PROTOCOL_VERSION, pid=pid, config_hash="h")


def _membership() -> Membership:
    return Membership("tcp://10.0.0.1:5571", "tcp://10.0.0.1:5572")


def _ready(m: Membership, rank: int, pid: int = 100) -> int:
    m.on_hello(_hello(rank, pid), 0.0)
    m.on_ready_response(rank, ReadyResponse(rank, 256, 100, 16, 1584, 320, "m"), 0.0)
    m.on_ready(rank, 0.0)
    return m.members[rank].incarnation


def test_a_closed_input_connection_kills_the_current_incarnation() -> None:
    m = _membership()
    incarnation = _ready(m, 0)
    dead = m.on_disconnected(0, incarnation, handshake=False)
    assert dead is not None and dead.state is RankState.DEAD
    assert "connection closed" in dead.dead_reason
    assert m.on_disconnected(0, incarnation, handshake=False) is None  # once only


def test_a_closed_handshake_connection_kills_only_a_rank_still_starting() -> None:
    m = _membership()
    incarnation = _ready(m, 0)
    assert m.on_disconnected(0, incarnation, handshake=True) is None  # closed after READY
    assert m.members[0].state is RankState.READY
    m.on_hello(_hello(1), 0.0)
    loading = m.members[1].incarnation
    dead = m.on_disconnected(1, loading, handshake=True)
    assert dead is not None and "while it was starting" in dead.dead_reason


def test_an_old_incarnations_close_spares_the_new_one() -> None:
    m = _membership()
    old = _ready(m, 0)
    new = _ready(m, 0)  # the same process handshakes again
    assert new != old
    assert m.on_disconnected(0, old, handshake=False) is None
    assert m.on_disconnected(0, old, handshake=True) is None
    assert m.members[0].state is RankState.READY


def test_a_draining_rank_that_hangs_up_left_cleanly() -> None:
    m = _membership()
    incarnation = _ready(m, 0)
    m.on_stats(0, EngineStats(draining=True), 1.0)
    dead = m.on_disconnected(0, incarnation, handshake=False)
    assert dead is not None and dead.state is RankState.DEAD
    assert "left" in dead.dead_reason


def test_a_local_process_exit_kills_only_the_process_that_holds_the_rank() -> None:
    m = _membership()
    _ready(m, 0, pid=111)
    assert m.on_process_exited(0, 222, "was killed by SIGKILL") is None  # an older process
    assert m.on_process_exited(5, 111, "exited with code 1") is None  # never said HELLO
    dead = m.on_process_exited(0, 111, "was killed by SIGKILL (exit code -9)")
    assert dead is not None and "SIGKILL" in dead.dead_reason
