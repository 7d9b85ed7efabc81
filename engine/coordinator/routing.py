"""Routing policies: which data-parallel rank gets a new request. Pure logic, no I/O.

Load score ``4 * waiting + running`` as vLLM's ``DPLBAsyncMPClient``: a waiting request weighs
more, not having even started its prefill. The caller's side of the contract (not enforced here):

* ``RankLoad.waiting`` is the rank's latest ``EngineStats.num_waiting_reqs`` **plus one for every
  request routed there since those stats** (the optimistic bump), reset when fresh stats arrive.
  Stats come only every few hundred ms; without the bump a burst would all go to one rank.
* ``RankLoad.accepting`` is False until the rank's handshake is done, and once it drains or dies.
* ``forget_rank`` is called when a rank leaves or dies, so a pod restarted under the same id
  (cold prefix cache) is not credited with its predecessor's prefixes.
* ``prefix-aware`` remembers where this process sent each prefix; ``prefix-hash`` derives the rank
  from the prefix itself, so several coordinators that share nothing agree (docs/coordinator.md).
* Policies hold small mutable state and are not thread-safe: call them from one thread.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import ClassVar

from corefleet.engine.core.block_hash import BlockHash, hash_full_blocks

WAITING_WEIGHT = 4


@dataclass(frozen=True)
class RankLoad:
    """What the router knows of one rank when it routes."""

    rank: int
    waiting: int  # from the rank's latest EngineStats plus requests routed there since
    running: int
    accepting: bool  # handshake done, not draining, not dead

    @property
    def score(self) -> int:
        """Load score, lower is better: ``4 * waiting + running``."""
        return WAITING_WEIGHT * self.waiting + self.running


def _by_rank(load: RankLoad) -> int:
    return load.rank


class NoRankAvailable(RuntimeError):
    """No rank can take the request now; the message says why."""


def prefix_block_hashes(
    token_ids: Sequence[int], block_size: int, cache_salt: str | None = None
) -> list[BlockHash]:
    """Chained hashes of the full blocks of ``token_ids`` exactly as the engine computes them, so
    a prefix the router considers shared is one the engine's prefix cache can reuse."""
    return hash_full_blocks(token_ids, block_size, cache_salt)


def _candidates(ranks: Sequence[RankLoad], exclude: Collection[int]) -> list[RankLoad]:
    """Accepting, non-excluded ranks in rank order, or NoRankAvailable saying why there are none."""
    if not ranks:
        raise NoRankAvailable("no rank available: no rank has completed its handshake yet")
    found = sorted((r for r in ranks if r.accepting and r.rank not in exclude), key=_by_rank)
    if not found:
        idle = sum(1 for r in ranks if not r.accepting)
        excluded = sum(1 for r in ranks if r.accepting and r.rank in exclude)
        raise NoRankAvailable(
            f"no rank available: of {len(ranks)} known ranks, {idle} are not accepting "
            f"(starting, draining or dead) and {excluded} already failed this request"
        )
    return found


class RoutingPolicy(ABC):
    """Chooses a rank per request. Subclasses set ``name`` (the ``--routing`` flag value)."""

    name: ClassVar[str]

    def choose(
        self,
        prompt_token_ids: Sequence[int],
        ranks: Sequence[RankLoad],
        exclude: Collection[int] = (),
        *,
        cache_salt: str | None = None,
    ) -> int:
        """The rank for this request among accepting ranks not in ``exclude`` (a request re-sent
        after a refusal or a rank death excludes the ranks that failed it). ``cache_salt``, the
        request's, matters only to the prefix policies. Raises NoRankAvailable."""
        return self._select(prompt_token_ids, _candidates(ranks, exclude), cache_salt)

    @abstractmethod
    def _select(
        self, prompt_token_ids: Sequence[int], candidates: list[RankLoad], cache_salt: str | None
    ) -> int:
        """The rank among ``candidates``: accepting, not excluded, in rank order, never empty."""

    def forget_rank(self, rank: int) -> None:  # noqa: B027  (optional hook, default no state)
        """A rank left or died: drop any state about it."""


class LeastLoaded(RoutingPolicy):
    """Lowest ``4 * waiting + running``; ties go to the first rank from a start that rotates
    each call (as in vLLM), so equal ranks, e.g. all idle before the first stats, share load."""

    name = "least-loaded"

    def __init__(self) -> None:
        self._turn = 0

    def _select(
        self, prompt_token_ids: Sequence[int], candidates: list[RankLoad], cache_salt: str | None
    ) -> int:
        return self.pick(candidates)

    def pick(self, candidates: Sequence[RankLoad]) -> int:
        """Least-loaded among already-filtered, non-empty ``candidates``."""
        start = self._turn % len(candidates)
        self._turn += 1
        rotated = [*candidates[start:], *candidates[:start]]
        return min(rotated, key=lambda r: r.score).rank  # min keeps the first of equal scores


class RoundRobin(RoutingPolicy):
    """Cycles over accepting, non-excluded ranks in rank order. It remembers the last rank id
    rather than a position, so ranks leaving or joining neither stall nor skip the cycle."""

    name = "round-robin"

    def __init__(self) -> None:
        self._last: int | None = None

    def _select(
        self, prompt_token_ids: Sequence[int], candidates: list[RankLoad], cache_salt: str | None
    ) -> int:
        last = self._last
        after = [r.rank for r in candidates if last is None or r.rank > last]
        self._last = after[0] if after else candidates[0].rank  # wrap around to the lowest rank
        return self._last


class PrefixAware(RoutingPolicy):
    """Sends a prompt to the rank that last received its longest prefix unless that rank is
    overloaded; otherwise, and for prompts under one block, it routes least-loaded.

    Memory: an LRU of up to ``max_entries`` block hashes -> rank that last received the block
    (100k blocks of 16 tokens cover 1.6M prompt tokens in a few tens of MB). The holder is used
    only if its score <= ``min_score + max(slack_abs, slack_frac * min_score)``. The defaults,
    ``slack_abs=8`` (two queued requests) and ``slack_frac=0.25``, let a cache hit beat a slightly
    shorter queue but stop one hot prefix piling up on a rank: past the bound the prompt goes
    least-loaded and that rank becomes the prefix's holder, so a hot prefix spreads with load.
    """

    name = "prefix-aware"

    def __init__(
        self,
        block_size: int = 16,
        *,
        max_entries: int = 100_000,
        slack_abs: int = 8,
        slack_frac: float = 0.25,
    ) -> None:
        if block_size < 1 or max_entries < 1 or slack_abs < 0 or slack_frac < 0:
            raise ValueError(
                "PrefixAware needs block_size, max_entries >= 1 and slack >= 0, got "
                f"{block_size=}, {max_entries=}, {slack_abs=}, {slack_frac=}"
            )
        self.block_size = block_size
        self.max_entries = max_entries
        self.slack_abs = slack_abs
        self.slack_frac = slack_frac
        self._least = LeastLoaded()
        # block hash -> (rank, that rank's epoch when recorded). forget_rank bumps the epoch,
        # which invalidates all the rank's entries in O(1); stale ones age out of the LRU.
        self._holders: OrderedDict[BlockHash, tuple[int, int]] = OrderedDict()
        self._epochs: dict[int, int] = {}

    def __len__(self) -> int:
        """Number of remembered block hashes (never more than ``max_entries``)."""
        return len(self._holders)

    def _select(
        self, prompt_token_ids: Sequence[int], candidates: list[RankLoad], cache_salt: str | None
    ) -> int:
        hashes = prefix_block_hashes(prompt_token_ids, self.block_size, cache_salt)
        if not hashes:
            return self._least.pick(candidates)  # nothing cacheable to be affine to
        by_rank = {r.rank: r for r in candidates}
        holder = self._longest_prefix_holder(hashes, by_rank)
        min_score = min(r.score for r in candidates)
        bound = min_score + max(self.slack_abs, self.slack_frac * min_score)
        if holder is not None and holder.score <= bound:
            chosen = holder.rank
        else:
            chosen = self._least.pick(candidates)
        self._record(hashes, chosen)
        return chosen

    def forget_rank(self, rank: int) -> None:
        self._epochs[rank] = self._epochs.get(rank, 0) + 1

    def _longest_prefix_holder(
        self, hashes: Sequence[BlockHash], by_rank: dict[int, RankLoad]
    ) -> RankLoad | None:
        # Hashes chain, so a hit at depth i means that rank got the whole prefix up to block i:
        # the deepest usable hit is the longest prefix. A miss ends the walk (nothing deeper).
        best: RankLoad | None = None
        for block_hash in hashes:
            entry = self._holders.get(block_hash)
            if entry is None:
                break
            rank, epoch = entry
            if epoch == self._epochs.get(rank, 0) and rank in by_rank:
                best = by_rank[rank]
        return best

    def _record(self, hashes: Sequence[BlockHash], rank: int) -> None:
        # Deepest block first, so a prompt's first blocks are the most recently used and evicted
        # last: shared system prompts stay, and no deep block outlives its (unreachable) prefix.
        entry = (rank, self._epochs.get(rank, 0))
        holders = self._holders
        for block_hash in reversed(hashes):
            holders[block_hash] = entry
            holders.move_to_end(block_hash)
        while len(holders) > self.max_entries:
            holders.popitem(last=False)


class PrefixHash(RoutingPolicy):
    """Sends a prefix to a rank computed from the prefix alone, so every coordinator agrees.

    For fleets with several coordinators that do not talk to each other (each has its own
    ``PrefixAware`` memory, so they would scatter one prefix over the ranks). Key: the engine's
    chained hash of the prompt's first ``min(full blocks, key_blocks)`` blocks (``cache_salt``
    included), i.e. 128 tokens at the defaults: prompts sharing a longer system prompt meet on one
    rank, prompts sharing less spread. Only those blocks are hashed, whatever the prompt's length.

    Rank: rendezvous (highest-random-weight) hashing. Each candidate rank weighs
    ``blake2b(key || rank)``, a hash that is the same in every process and on every machine
    (Python's ``hash()`` is salted per process). The order depends only on the key and the set of
    ranks: a rank leaving moves only its own keys, spread over the others, and a rank joining
    takes ~1/N of all keys, evenly from the others; there is no ring or table to keep in sync.

    Load: the first rank in that order whose score is ``<= min_score + max(slack_abs, slack_frac
    * min_score)`` (PrefixAware's bound and defaults). The bound is relative to the least-loaded
    rank, so coordinators whose views differ only by their own recent routing (the optimistic
    bump) mostly agree. A hot prefix over its bound spills to the *next* rank in its order rather
    than to the least-loaded one, so every coordinator spills it to the same second rank, which
    warms its cache, instead of scattering it. Prompts under one block go least-loaded.

    State: none per request (memory stays bounded whatever clients send); cost per request is
    ``key_blocks`` block hashes plus one small hash per candidate rank. ``forget_rank`` has nothing
    to forget: a pod restarted under the same rank id gets the same keys back.
    """

    name = "prefix-hash"

    def __init__(
        self,
        block_size: int = 16,
        *,
        key_blocks: int = 8,
        slack_abs: int = 8,
        slack_frac: float = 0.25,
    ) -> None:
        if block_size < 1 or key_blocks < 1 or slack_abs < 0 or slack_frac < 0:
            raise ValueError(
                "PrefixHash needs block_size, key_blocks >= 1 and slack >= 0, got "
                f"{block_size=}, {key_blocks=}, {slack_abs=}, {slack_frac=}"
            )
        self.block_size = block_size
        self.key_blocks = key_blocks
        self.slack_abs = slack_abs
        self.slack_frac = slack_frac
        self._least = LeastLoaded()

    def key_hashes(
        self, prompt_token_ids: Sequence[int], cache_salt: str | None = None
    ) -> list[BlockHash]:
        """The chained hashes of the prompt's first ``min(full blocks, key_blocks)`` blocks; the
        last one is the routing key (empty under one block). Equal to the first hashes the engine
        computes for the prompt, so a key shared by two prompts is a prefix its cache can reuse."""
        # Slice before hashing: a 1M-token prompt costs 8 block hashes here, not 62,500.
        head = prompt_token_ids[: self.key_blocks * self.block_size]
        return prefix_block_hashes(head, self.block_size, cache_salt)

    def order(self, key: BlockHash, ranks: Collection[int]) -> list[int]:
        """``ranks`` by decreasing rendezvous weight for ``key``: the order every coordinator
        tries them in."""
        return sorted(ranks, key=lambda rank: _rendezvous_weight(key, rank), reverse=True)

    def _select(
        self, prompt_token_ids: Sequence[int], candidates: list[RankLoad], cache_salt: str | None
    ) -> int:
        hashes = self.key_hashes(prompt_token_ids, cache_salt)
        if not hashes:
            return self._least.pick(candidates)  # nothing cacheable to be affine to
        key = hashes[-1]
        min_score = min(r.score for r in candidates)
        bound = min_score + max(self.slack_abs, self.slack_frac * min_score)
        # The first within the bound in rendezvous order is the heaviest such rank: one pass. The
        # least-loaded rank is always within the bound, so there is always one.
        within = (r.rank for r in candidates if r.score <= bound)
        return max(within, key=lambda rank: _rendezvous_weight(key, rank))


def _rendezvous_weight(key: BlockHash, rank: int) -> int:
    """Stable 64-bit weight of ``(key, rank)``: identical across processes, machines and Python
    versions. Changing it makes coordinators of different versions disagree during a rollout."""
    payload = key + rank.to_bytes(8, "big", signed=True)
    return int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "big")


_POLICIES: dict[str, type[RoutingPolicy]] = {
    cls.name: cls for cls in (LeastLoaded, RoundRobin, PrefixAware, PrefixHash)
}
POLICY_NAMES: tuple[str, ...] = tuple(_POLICIES)


def make_policy(name: str, block_size: int = 16) -> RoutingPolicy:
    """The policy for a ``--routing`` value; ``block_size`` must be the engines' block size."""
    if name == PrefixAware.name:
        return PrefixAware(block_size)
    if name == PrefixHash.name:
        return PrefixHash(block_size)
    if name not in _POLICIES:
        raise ValueError(f"unknown routing policy {name!r}, not one of {', '.join(POLICY_NAMES)}")
    return _POLICIES[name]()
