"""A request's ``priority`` reaches the engine requests, under ranks that schedule by it."""

from __future__ import annotations

import pytest

from corefleet.engine.messages import ReadyResponse
from corefleet.engine.openai.errors import RequestError
from corefleet.engine.openai.generation_api import _priority


def _ranks(policy: str) -> ReadyResponse:
    return ReadyResponse(0, 64, 10, 4, 36, 100, "m", scheduling_policy=policy)


def test_priority_is_passed_under_priority_scheduling() -> None:
    assert _priority(-7, _ranks("priority")) == -7
    assert _priority(None, _ranks("priority")) == 0


def test_a_priority_fcfs_ranks_would_ignore_is_refused() -> None:
    assert _priority(0, _ranks("fcfs")) == 0
    with pytest.raises(RequestError) as err:
        _priority(2**63 - 1, _ranks("fcfs"))
    assert err.value.param == "priority"


def test_the_ready_message_carries_the_policy_and_older_ranks_mean_fcfs() -> None:
    import msgspec

    wire = msgspec.msgpack.encode(_ranks("priority"))
    assert msgspec.msgpack.decode(wire, type=ReadyResponse).scheduling_policy == "priority"
    assert ReadyResponse(0, 64, 10, 4, 36, 100, "m").scheduling_policy == "fcfs"
