"""The ``prefix-hash`` routing policy: coordinators that share nothing send a prefix to one rank."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections import Counter
from collections.abc import Sequence

import pytest

from corefleet.engine.coordinator.routing import (
    PrefixHash,
    RankLoad,
    make_policy,
    prefix_block_hashes,
)
from corefleet.engine.core import block_hash
from tests.unit.routing_helpers import BS, idle, prompt, with_load

PROMPTS = [prompt(seed, 10) for seed in range(200)]


def route_all(policy: PrefixHash, ranks: list[RankLoad]) -> list[int]:
    return [policy.choose(p, ranks) for p in PROMPTS]


# --- agreement across coordinators ----------------------------------------------------------


def test_two_coordinators_agree_and_spread() -> None:
    a, b = PrefixHash(BS), PrefixHash(BS)
    ranks = idle(4)
    choices = route_all(a, ranks)
    assert route_all(b, ranks) == choices
    # Input order of the ranks does not matter either (each coordinator lists its own members).
    assert route_all(b, list(reversed(ranks))) == choices
    # Distinct prefixes spread: ~50 each, none starved or hot.
    assert all(30 <= n <= 70 for n in Counter(choices).values())
    assert set(choices) == {0, 1, 2, 3}


def test_coordinators_agree_with_different_recent_bumps_within_slack() -> None:
    # Each coordinator adds its own optimistic bumps (up to 2 waiting = score 8, the slack) to the
    # shared stats; neither view moves any prefix off its rendezvous rank.
    a, b = PrefixHash(BS), PrefixHash(BS)
    rng = random.Random(7)
    baseline = route_all(PrefixHash(BS), idle(4))
    for p, expected in zip(PROMPTS, baseline, strict=True):
        view_a = [RankLoad(r, rng.randint(0, 2), 0, True) for r in range(4)]
        view_b = [RankLoad(r, rng.randint(0, 2), 0, True) for r in range(4)]
        assert a.choose(p, view_a) == b.choose(p, view_b) == expected


def test_same_prefix_same_rank_beyond_the_key() -> None:
    policy = PrefixHash(BS, key_blocks=8)
    ranks = idle(8)
    system = prompt(1, 8)  # a 128-token system prompt: the whole key
    chosen = {policy.choose(system + prompt(100 + i, 3, extra=i), ranks) for i in range(20)}
    assert len(chosen) == 1
    # Sharing only 4 blocks (64 tokens) is not enough to meet: those prompts spread.
    short_shared = {policy.choose(prompt(1, 4) + prompt(200 + i, 6), ranks) for i in range(20)}
    assert len(short_shared) > 1


# --- membership changes ---------------------------------------------------------------------


def test_rank_leaving_moves_only_its_own_keys() -> None:
    policy = PrefixHash(BS)
    before = route_all(policy, idle(4))
    after = route_all(policy, with_load(idle(4), 2, accepting=False))
    moved = [(b, a) for b, a in zip(before, after, strict=True) if b != a]
    assert moved and all(b == 2 for b, _ in moved)
    assert len(moved) == before.count(2)  # every key of rank 2 moved, and only those
    assert {a for _, a in moved} == {0, 1, 3}  # spread over the survivors, not dumped on one


def test_rank_joining_takes_a_fair_share_and_nothing_else_moves() -> None:
    policy = PrefixHash(BS)
    before = route_all(policy, idle(4))
    after = route_all(policy, idle(5))
    moved = [a for b, a in zip(before, after, strict=True) if b != a]
    assert set(moved) == {4}  # keys move only to the new rank
    assert 20 <= len(moved) <= 60  # ~1/5 of 200


def test_excluded_rank_falls_to_the_next_in_rendezvous_order() -> None:
    policy = PrefixHash(BS)
    ranks = idle(4)
    p = PROMPTS[0]
    order = policy.order(policy.key_hashes(p)[-1], [r.rank for r in ranks])
    assert policy.choose(p, ranks) == order[0]
    assert policy.choose(p, ranks, exclude={order[0]}) == order[1]


# --- load ----------------------------------------------------------------------------------


def test_load_bound_diverts_hot_prefix_to_the_same_second_rank() -> None:
    a, b = PrefixHash(BS, slack_abs=8, slack_frac=0.25), PrefixHash(BS)
    ranks = idle(4)
    hot = prompt(1, 10)
    first, second = a.order(a.key_hashes(hot)[-1], range(4))[:2]
    # Within the bound (score 8 <= 0 + max(8, 0)): affinity beats a shorter queue.
    assert a.choose(hot, with_load(ranks, first, waiting=2)) == first
    # Beyond it (12 > 8): the next rank in the prefix's order, the same in every coordinator.
    overloaded = with_load(ranks, first, waiting=3)
    assert a.choose(hot, overloaded) == b.choose(hot, overloaded) == second
    # The overload clears: back to the first rank.
    assert a.choose(hot, ranks) == first


def test_load_bound_is_relative_at_high_load() -> None:
    policy = PrefixHash(BS)
    base = [RankLoad(i, waiting=0, running=100, accepting=True) for i in range(2)]
    first = policy.choose(prompt(1, 10), base)
    # min 100, bound 125: 120 stays, 130 diverts.
    assert policy.choose(prompt(1, 10), with_load(base, first, running=120)) == first
    assert policy.choose(prompt(1, 10), with_load(base, first, running=130)) != first


def test_hot_prefix_spreads_under_optimistic_bump() -> None:
    policy = PrefixHash(BS)
    waiting = [0, 0, 0, 0]
    for _ in range(40):
        loads = [RankLoad(i, waiting[i], 0, True) for i in range(4)]
        waiting[policy.choose(prompt(1, 10), loads)] += 1
    # No rank gets more than the bound (2 waiting) plus one request ahead of the others.
    assert max(waiting) - min(waiting) <= 3
    assert sum(waiting) == 40


# --- the key ---------------------------------------------------------------------------------


def test_key_is_the_engines_hash_of_the_first_key_blocks_with_salt() -> None:
    policy = PrefixHash(BS, key_blocks=8)
    p = prompt(1, 20)
    assert policy.key_hashes(p) == prefix_block_hashes(p, BS)[:8]
    assert policy.key_hashes(p, "tenant-a") == prefix_block_hashes(p, BS, "tenant-a")[:8]
    assert policy.key_hashes(p, "tenant-a")[-1] != policy.key_hashes(p)[-1]
    assert len(policy.key_hashes(prompt(1, 3, extra=5))) == 3  # shorter prompts: all full blocks


def test_cache_salt_changes_the_rank() -> None:
    policy = PrefixHash(BS)
    ranks = idle(4)
    plain = route_all(policy, ranks)
    salted = [policy.choose(p, ranks, cache_salt="tenant-a") for p in PROMPTS]
    # Independent keys over 4 ranks: ~3/4 differ. Same salt, same ranks in every coordinator.
    assert sum(x != y for x, y in zip(plain, salted, strict=True)) >= 100
    assert [PrefixHash(BS).choose(p, ranks, cache_salt="tenant-a") for p in PROMPTS] == salted


def test_prompts_under_one_block_go_least_loaded() -> None:
    policy = PrefixHash(BS)
    ranks = with_load(idle(3), 0, running=2)
    short = prompt(1, 0, extra=BS - 1)
    assert policy.key_hashes(short) == []
    assert {policy.choose(short, ranks) for _ in range(6)} == {1, 2}  # rotating ties


def test_absurd_prompt_hashes_only_the_key_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    hashed: list[int] = []
    real = block_hash.hash_block_tokens

    def counting(
        parent: bytes | None, tokens: Sequence[int], extra: tuple[str, ...] | None = None
    ) -> bytes:
        hashed.append(len(tokens))
        return real(parent, tokens, extra)

    monkeypatch.setattr(block_hash, "hash_block_tokens", counting)
    policy = PrefixHash(BS, key_blocks=8)
    huge = prompt(1, 62_500)  # 1,000,000 tokens
    rank = policy.choose(huge, idle(4))
    assert hashed == [BS] * 8  # 8 blocks of the 62,500
    assert rank == policy.choose(huge[: 8 * BS], idle(4))  # its 128-token head routes the same


# --- stability ------------------------------------------------------------------------------

_CHILD = """
import json, sys
from corefleet.engine.coordinator.routing import PrefixHash, RankLoad
ranks = [RankLoad(r, 0, 0, True) for r in range(8)]
policy = PrefixHash(16)
prompts = [[s * 100_000 + i for i in range(160)] for s in range(50)]
print(json.dumps({
    "plain": [policy.choose(p, ranks) for p in prompts],
    "salted": [policy.choose(p, ranks, cache_salt="t") for p in prompts],
    "str_hash": hash("corefleet"),
}))
"""


def test_choices_are_stable_across_processes_with_other_hash_seeds() -> None:
    seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"
    child = subprocess.run(
        [sys.executable, "-c", _CHILD],
        env={**os.environ, "PYTHONHASHSEED": seed},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    theirs = json.loads(child.stdout)
    assert theirs["str_hash"] != hash("corefleet")  # the child really hashes str differently
    policy = PrefixHash(BS)
    ranks = idle(8)
    prompts = [prompt(s, 10) for s in range(50)]
    assert theirs["plain"] == [policy.choose(p, ranks) for p in prompts]
    assert theirs["salted"] == [policy.choose(p, ranks, cache_salt="t") for p in prompts]


# The ranks of prompt(0..15, 10 blocks) over 8 idle ranks, as computed when the policy was written.
GOLDEN = [6, 1, 6, 5, 7, 0, 2, 2, 0, 6, 0, 2, 6, 0, 2, 7]


def test_choices_are_pinned_across_versions() -> None:
    # Coordinators of two versions run side by side during a rolling update: a change to the key
    # or the weight function must be deliberate (and announced), never a side effect.
    policy = PrefixHash(BS)
    assert [policy.choose(prompt(s, 10), idle(8)) for s in range(16)] == GOLDEN


def test_make_policy_builds_prefix_hash_with_the_block_size() -> None:
    policy = make_policy("prefix-hash", block_size=32)
    assert isinstance(policy, PrefixHash)
    assert policy.block_size == 32


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="block_size"):
        PrefixHash(0)
    with pytest.raises(ValueError, match="key_blocks"):
        PrefixHash(BS, key_blocks=0)
    with pytest.raises(ValueError, match="slack"):
        PrefixHash(BS, slack_abs=-1)
