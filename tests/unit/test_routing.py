"""Routing policies of the coordinator: least-loaded, round-robin and prefix-aware (pure logic)."""

from __future__ import annotations

from collections import Counter

import pytest

from corefleet.engine.coordinator.routing import (
    POLICY_NAMES,
    LeastLoaded,
    NoRankAvailable,
    PrefixAware,
    RankLoad,
    RoundRobin,
    RoutingPolicy,
    make_policy,
    prefix_block_hashes,
)
from corefleet.engine.core.block_hash import make_block_hasher
from corefleet.engine.messages import SamplingParams
from corefleet.engine.request import Request
from corefleet.operator.spec import ROUTING_FLAGS
from tests.unit.routing_helpers import BS, idle, prompt, with_load

# --- least-loaded ---------------------------------------------------------------------------


def test_least_loaded_picks_min_score_and_waiting_weighs_four() -> None:
    ranks = [
        RankLoad(0, waiting=1, running=0, accepting=True),  # score 4
        RankLoad(1, waiting=0, running=3, accepting=True),  # score 3
        RankLoad(2, waiting=2, running=1, accepting=True),  # score 9
    ]
    policy = LeastLoaded()
    assert {policy.choose([1, 2, 3], ranks) for _ in range(6)} == {1}


def test_least_loaded_skips_non_accepting_and_excluded() -> None:
    ranks = [
        RankLoad(0, waiting=0, running=0, accepting=False),  # idlest, but draining
        RankLoad(1, waiting=0, running=1, accepting=True),  # next, but failed this request
        RankLoad(2, waiting=0, running=5, accepting=True),
    ]
    policy = LeastLoaded()
    assert {policy.choose([1], ranks, exclude={1}) for _ in range(5)} == {2}
    assert policy.choose([1], ranks) == 1


def test_least_loaded_spreads_equal_ranks() -> None:
    policy = LeastLoaded()
    counts = Counter(policy.choose([1], idle(4)) for _ in range(40))
    assert counts == {0: 10, 1: 10, 2: 10, 3: 10}


def test_least_loaded_with_optimistic_bump_fills_evenly() -> None:
    # The caller's contract: each routed request counts as +1 waiting until fresh stats.
    policy = LeastLoaded()
    waiting = [0, 0, 0]
    for _ in range(9):
        loads = [RankLoad(i, waiting[i], 0, True) for i in range(3)]
        waiting[policy.choose([1], loads)] += 1
    assert waiting == [3, 3, 3]


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_no_rank_available_says_why(name: str) -> None:
    policy = make_policy(name)
    with pytest.raises(NoRankAvailable, match="handshake"):
        policy.choose(prompt(1, 2), [])
    draining = [RankLoad(i, 0, 0, accepting=False) for i in range(3)]
    with pytest.raises(NoRankAvailable, match="3 are not accepting"):
        policy.choose(prompt(1, 2), draining)
    with pytest.raises(NoRankAvailable, match="2 already failed"):
        policy.choose(prompt(1, 2), idle(2), exclude=[0, 1])


# --- round-robin ----------------------------------------------------------------------------


def test_round_robin_cycles_in_rank_order() -> None:
    policy = RoundRobin()
    ranks = list(reversed(idle(3)))  # input order must not matter
    assert [policy.choose([1], ranks) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_round_robin_skips_draining_rank_without_stalling() -> None:
    policy = RoundRobin()
    ranks = idle(4)
    assert [policy.choose([1], ranks) for _ in range(2)] == [0, 1]
    draining = with_load(ranks, 2, accepting=False)
    assert [policy.choose([1], draining) for _ in range(5)] == [3, 0, 1, 3, 0]
    # Rank 2 back: the cycle resumes in order after the last rank chosen (0).
    assert [policy.choose([1], ranks) for _ in range(4)] == [1, 2, 3, 0]


def test_round_robin_skips_excluded_and_ignores_load() -> None:
    policy = RoundRobin()
    ranks = with_load(idle(3), 1, waiting=50)
    assert [policy.choose([1], ranks, exclude={0}) for _ in range(4)] == [1, 2, 1, 2]


# --- prefix-aware ---------------------------------------------------------------------------


def test_router_hashes_match_engine_prefix_cache() -> None:
    tokens = prompt(7, 5, extra=3)
    for salt in (None, "tenant-a"):
        request = Request(
            "r",
            tokens,
            SamplingParams(),
            eos_token_id=None,
            cache_salt=salt,
            block_hasher=make_block_hasher(BS),
        )
        assert prefix_block_hashes(tokens, BS, salt) == request.block_hashes
        assert len(request.block_hashes) == 5


def test_prefix_aware_same_prompt_sticks_to_one_rank() -> None:
    policy = PrefixAware(BS)
    ranks = idle(4)
    first = policy.choose(prompt(1, 5), ranks)
    assert [policy.choose(prompt(1, 5), ranks) for _ in range(10)] == [first] * 10


def test_prefix_aware_shared_prefix_follows_and_new_prompt_goes_least_loaded() -> None:
    policy = PrefixAware(BS)
    ranks = idle(4)
    holder = policy.choose(prompt(1, 5), ranks)
    diverging = prompt(1, 3) + prompt(2, 2)  # same first 3 blocks, then different
    assert policy.choose(diverging, ranks) == holder
    # A fresh prompt ignores the holder and goes to the strictly least-loaded rank.
    loaded = [RankLoad(r.rank, 0, 0 if r.rank == 2 else 1, True) for r in ranks]
    assert policy.choose(prompt(3, 5), loaded) == 2
    # ... and with equal loads fresh prompts spread instead of all landing on one rank.
    fresh = {policy.choose(prompt(10 + i, 5), ranks) for i in range(8)}
    assert fresh == {0, 1, 2, 3}


def test_prefix_aware_longest_prefix_wins() -> None:
    policy = PrefixAware(BS)
    ranks = idle(3)
    shared = prompt(1, 2)
    a = policy.choose(shared + prompt(2, 3), ranks)  # 5 blocks recorded for rank a
    b = policy.choose(prompt(4, 2), with_load(ranks, a, waiting=1))  # unrelated, lands elsewhere
    assert b != a
    policy.choose(shared, with_load(ranks, a, waiting=9))  # a overloaded: 2 shared blocks -> c
    # A prompt matching all 5 blocks goes back to a (deeper match), not to the shared-prefix holder.
    assert policy.choose(shared + prompt(2, 3), ranks) == a


def test_prefix_aware_overload_bound_diverts_and_returns() -> None:
    policy = PrefixAware(BS, slack_abs=8, slack_frac=0.25)
    ranks = idle(3)
    holder = policy.choose(prompt(1, 5), ranks)
    # Within the bound (score 8 <= 0 + max(8, 0)): affinity wins over a shorter queue.
    assert policy.choose(prompt(1, 5), with_load(ranks, holder, waiting=2)) == holder
    # Beyond it (score 12 > 8): least-loaded elsewhere, which becomes the new holder.
    hot = with_load(ranks, holder, waiting=3)
    moved = policy.choose(prompt(1, 5), hot)
    assert moved != holder
    assert policy.choose(prompt(1, 5), with_load(hot, moved, waiting=1)) == moved
    # Load evens out: the prefix stays where it now lives (its latest holder).
    assert policy.choose(prompt(1, 5), ranks) == moved
    # A prefix that never moved returns to its holder once its overload clears.
    p2 = policy.choose(prompt(2, 5), ranks)
    assert policy.choose(prompt(2, 4), with_load(ranks, p2, waiting=5)) != p2  # records 4 blocks
    assert policy.choose(prompt(2, 5), ranks) == p2  # the 5th block is still only on p2


def test_prefix_aware_relative_slack_at_high_load() -> None:
    policy = PrefixAware(BS, slack_abs=8, slack_frac=0.25)
    base = [RankLoad(i, waiting=0, running=100, accepting=True) for i in range(2)]
    holder = policy.choose(prompt(1, 5), base)
    # min 100, bound 125: 120 stays, 130 diverts.
    assert policy.choose(prompt(1, 5), with_load(base, holder, running=120)) == holder
    assert policy.choose(prompt(1, 5), with_load(base, holder, running=130)) != holder


def test_prefix_aware_hot_prefix_spreads_under_optimistic_bump() -> None:
    policy = PrefixAware(BS)
    waiting = [0, 0, 0, 0]
    for _ in range(40):
        loads = [RankLoad(i, waiting[i], 0, True) for i in range(4)]
        waiting[policy.choose(prompt(1, 5), loads)] += 1
    # No rank is ever more than the bound (8 = 2 waiting) plus one request ahead of the others.
    assert max(waiting) - min(waiting) <= 3
    assert sum(waiting) == 40


def test_prefix_aware_skips_draining_or_excluded_holder() -> None:
    policy = PrefixAware(BS)
    ranks = idle(3)
    holder = policy.choose(prompt(1, 5), ranks)
    assert policy.choose(prompt(1, 5), ranks, exclude={holder}) != holder
    policy2 = PrefixAware(BS)
    holder2 = policy2.choose(prompt(1, 5), ranks)
    assert policy2.choose(prompt(1, 5), with_load(ranks, holder2, accepting=False)) != holder2


def test_prefix_aware_forget_rank_routes_fresh() -> None:
    policy = PrefixAware(BS)
    ranks = idle(2)
    holder = policy.choose(prompt(1, 5), ranks)
    other = 1 - holder
    policy.forget_rank(holder)
    # The holder (e.g. a pod restarted under the same rank id) is accepting but its cache is
    # cold: a slightly less loaded rank must win, as for any fresh prompt.
    assert policy.choose(prompt(1, 5), with_load(ranks, holder, running=1)) == other
    # New requests re-teach affinity for the forgotten rank normally.
    p = policy.choose(prompt(5, 5), with_load(ranks, other, running=1))
    assert p == holder
    assert policy.choose(prompt(5, 5), with_load(ranks, holder, running=1)) == holder


def test_prefix_aware_short_prompts_go_least_loaded() -> None:
    policy = PrefixAware(BS)
    ranks = with_load(idle(3), 0, running=2)
    short = prompt(1, 0, extra=BS - 1)
    chosen = [policy.choose(short, ranks) for _ in range(6)]
    assert set(chosen) == {1, 2}  # least-loaded with rotating ties; no affinity recorded
    assert len(policy) == 0


def test_prefix_aware_salt_separates_prefixes() -> None:
    policy = PrefixAware(BS)
    ranks = idle(2)
    holder = policy.choose(prompt(1, 5), ranks)
    other = 1 - holder
    salted = policy.choose(prompt(1, 5), with_load(ranks, holder, running=1), cache_salt="t")
    assert salted == other  # the engine would not share these blocks, so no affinity


def test_prefix_aware_lru_bound_holds() -> None:
    policy = PrefixAware(BS, max_entries=20)
    ranks = idle(3)
    for i in range(50):
        policy.choose(prompt(i, 5), ranks)
        assert len(policy) <= 20
    assert len(policy) == 20
    # The most recent prompts are still remembered whole, the oldest forgotten entirely.
    recent = policy.choose(prompt(49, 5), ranks)
    assert [policy.choose(prompt(49, 5), ranks) for _ in range(3)] == [recent] * 3
    # A prompt longer than the whole LRU keeps its first blocks (the ones a lookup walks first).
    long_policy = PrefixAware(BS, max_entries=4)
    holder = long_policy.choose(prompt(1, 10), ranks)
    assert len(long_policy) == 4
    assert long_policy.choose(prompt(1, 4), ranks) == holder


def test_prefix_aware_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="block_size"):
        PrefixAware(0)
    with pytest.raises(ValueError, match="max_entries"):
        PrefixAware(BS, max_entries=0)
    with pytest.raises(ValueError, match="slack"):
        PrefixAware(BS, slack_frac=-1)


# --- make_policy ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_make_policy_every_name(name: str) -> None:
    policy = make_policy(name, block_size=32)
    assert isinstance(policy, RoutingPolicy)
    assert policy.name == name
    assert policy.choose(prompt(1, 3), idle(2)) in (0, 1)
    if isinstance(policy, PrefixAware):
        assert policy.block_size == 32


def test_make_policy_accepts_every_operator_routing_flag() -> None:
    for crd_value, flag in ROUTING_FLAGS.items():
        assert make_policy(flag).name == flag, crd_value
    assert set(ROUTING_FLAGS.values()) == set(POLICY_NAMES)


def test_make_policy_unknown_lists_names() -> None:
    with pytest.raises(ValueError, match="least-loaded, round-robin, prefix-aware") as info:
        make_policy("random")
    assert "'random'" in str(info.value)
