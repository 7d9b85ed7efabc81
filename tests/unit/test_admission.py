"""API keys, the in-flight limiter and the request limits, without a server."""

from __future__ import annotations

import pytest

from corefleet.engine.openai.admission import ApiKeys, InFlightLimiter
from corefleet.engine.openai.errors import RequestError
from corefleet.engine.openai.limits import FALLBACK_MAX_N, RequestLimits


def test_api_keys_accept_each_configured_key_and_nothing_else() -> None:
    keys = ApiKeys(["alpha", "beta"])
    alpha, beta = keys.identify("Bearer alpha"), keys.identify("Bearer beta")
    assert alpha is not None and beta is not None and alpha != beta
    assert "alpha" not in alpha  # an id for per-key accounting, never the key itself
    for header in (None, "", "alpha", "Bearer ", "Bearer alph", "Bearer alphaa", "bearer alpha"):
        assert keys.identify(header) is None, header
    assert keys.identify("Bearer " + "x" * 1_000_000) is None
    assert not ApiKeys([]) and not ApiKeys([""]) and keys


def _limiter(capacity: int, per_key: int | None = None) -> InFlightLimiter:
    return InFlightLimiter(lambda: capacity, per_key)


def test_the_server_wide_bound_refuses_with_429_and_frees_on_release() -> None:
    limiter = _limiter(3)
    first = limiter.admit(None, 2)
    limiter.admit(None, 1)
    with pytest.raises(RequestError) as refused:
        limiter.admit(None, 1)
    assert refused.value.status == 429 and refused.value.code == "rate_limit_exceeded"
    first.release()
    first.release()  # idempotent: a stream that ends twice frees its place once
    assert limiter.in_flight == 1
    limiter.admit(None, 2)
    assert limiter.refused == 1


def test_a_request_heavier_than_the_bound_still_runs_alone() -> None:
    limiter = _limiter(2)
    big = limiter.admit(None, 5)
    with pytest.raises(RequestError):
        limiter.admit(None, 1)
    big.release()
    assert limiter.in_flight == 0


def test_the_per_key_bound_is_per_key_and_forgets_idle_keys() -> None:
    limiter = _limiter(100, per_key=1)
    a = limiter.admit("a", 1)
    with pytest.raises(RequestError) as refused:
        limiter.admit("a", 1)
    assert "API key" in refused.value.message
    b = limiter.admit("b", 1)
    a.release()
    b.release()
    assert limiter._per_key == {}  # memory does not grow with the keys ever seen


def test_capacity_follows_the_ranks() -> None:
    capacity = [1]
    limiter = InFlightLimiter(lambda: capacity[0], None)
    limiter.admit(None, 1)
    with pytest.raises(RequestError):
        limiter.admit(None, 1)
    capacity[0] = 2  # a second rank became ready
    limiter.admit(None, 1)


def test_limits_defaults_follow_the_ranks_and_flags_override() -> None:
    limits = RequestLimits()
    assert limits.effective_max_n(None) == FALLBACK_MAX_N
    assert limits.effective_max_n(8) == 8
    assert RequestLimits(max_n=3).effective_max_n(8) == 3
    assert limits.effective_max_concurrent(16) == 16
    assert RequestLimits(max_concurrent_requests=5).effective_max_concurrent(16) == 5


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_n": 0},
        {"max_concurrent_requests": -1},
        {"max_concurrent_requests_per_key": 0},
        {"max_request_body_bytes": 10},
        {"max_connections": 0},
        {"header_timeout_s": 0},
        {"body_timeout_s": -1},
    ],
)
def test_invalid_limits_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RequestLimits(**kwargs)  # type: ignore[arg-type]
