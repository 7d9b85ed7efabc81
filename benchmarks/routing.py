"""Routing policies with one or several coordinators: prefix-cache hits, queueing, cost per call.

A simulation, no engine: ``--ranks`` ranks, each with a prefix cache (an LRU of ``--cache-blocks``
block hashes, the engine's chained hashes) and ``--slots`` requests running at a time, behind
``--coordinators`` coordinators that each hold their own policy instance and share nothing. The
clients' requests are spread round-robin over the coordinators, as a Service spreads
connections. Every tick each rank sends its stats (waiting, running) to every coordinator, and
each coordinator adds its own optimistic bump for what it routed since, as ``FleetClient`` does.

Workload (seeded): ``--groups`` shared documents / system prompts of ``--shared-blocks`` blocks
with Zipf popularity, each request one of them plus a unique question of 1-8 blocks; a tenth of
the requests share nothing. Reported per policy and coordinator count: the fraction of prompt
blocks found in the chosen rank's cache (what prefix routing is for), the mean queueing delay in
ticks (what load balance is for), and the policy's CPU cost per call for a 2k- and a 100k-token
prompt (``choose`` alone, 8 ranks).

    python benchmarks/routing.py --coordinators 1 2 4
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

from corefleet.engine.coordinator.routing import RankLoad, RoutingPolicy, make_policy
from corefleet.engine.core.block_hash import BlockHash, hash_full_blocks

BS = 16
POLICIES = ("least-loaded", "round-robin", "prefix-aware", "prefix-hash")


@dataclass
class Job:
    tokens: list[int]
    hashes: list[BlockHash]  # all full blocks: what the rank's prefix cache would look up
    arrived: int
    duration: int


class Rank:
    """A rank in the simulation: a FIFO of waiting jobs, a few running, an LRU prefix cache."""

    def __init__(self, slots: int, cache_blocks: int) -> None:
        self.slots = slots
        self.cache_blocks = cache_blocks
        self.cache: OrderedDict[BlockHash, None] = OrderedDict()
        self.waiting: deque[Job] = deque()
        self.running: list[int] = []  # ticks left per running job

    def admit(self, job: Job) -> int:
        """Queue ``job`` and return how many of its blocks the prefix cache already holds."""
        hits = 0
        for h in job.hashes:  # the engine reuses only an unbroken prefix of cached blocks
            if h not in self.cache:
                break
            hits += 1
        for h in reversed(job.hashes):  # first blocks most recent: evicted last, as the engine
            self.cache[h] = None
            self.cache.move_to_end(h)
        while len(self.cache) > self.cache_blocks:
            self.cache.popitem(last=False)
        self.waiting.append(job)
        return hits

    def tick(self, now: int, delays: list[int]) -> None:
        """Advance one tick: running jobs progress, free slots take waiting jobs."""
        self.running = [left - 1 for left in self.running if left > 1]
        while self.waiting and len(self.running) < self.slots:
            job = self.waiting.popleft()
            delays.append(now - job.arrived)
            self.running.append(job.duration)


def workload(args: argparse.Namespace) -> list[tuple[list[int], list[BlockHash]]]:
    """The seeded requests' tokens and block hashes (shared prefixes hashed once)."""
    rng = random.Random(args.seed)
    shared = [
        [g * 1_000_000 + i for i in range(args.shared_blocks * BS)] for g in range(args.groups)
    ]
    shared_hashes = [hash_full_blocks(s, BS) for s in shared]
    weights = [1 / (g + 1) ** 1.1 for g in range(args.groups)]
    requests = []
    for n in range(args.requests):
        length = rng.randint(1, 8) * BS + rng.randint(0, 15)
        question = [10**9 + n * 1000 + i for i in range(length)]
        if rng.random() < 0.1:
            requests.append((question, hash_full_blocks(question, BS)))
            continue
        g = rng.choices(range(args.groups), weights)[0]
        tokens = shared[g] + question
        tail = hash_full_blocks(tokens, BS, first=len(shared[g]), parent=shared_hashes[g][-1])
        requests.append((tokens, shared_hashes[g] + tail))
    return requests


def simulate(policy_name: str, coordinators: int, args: argparse.Namespace) -> tuple[float, float]:
    """(fraction of prompt blocks hit in the chosen rank's cache, mean queueing delay in ticks)."""
    rng = random.Random(args.seed + 1)
    policies: list[RoutingPolicy] = [make_policy(policy_name, BS) for _ in range(coordinators)]
    ranks = [Rank(args.slots, args.cache_blocks) for _ in range(args.ranks)]
    pending = deque(workload(args))
    hits = blocks = 0
    delays: list[int] = []
    now = 0
    sent = 0
    while pending or any(r.waiting or r.running for r in ranks):
        stats = [(len(r.waiting), len(r.running)) for r in ranks]  # sent to every coordinator
        # Fresh stats reset each coordinator's bumps, which count only what *it* routed since.
        bumps = [[0] * args.ranks for _ in range(coordinators)]
        # Binomial arrivals at args.load of the fleet's capacity: a job lasts 4 ticks on average
        # (2-6), so ranks * slots / 4 jobs a tick fill it.
        trials = args.ranks * args.slots
        arrivals = sum(rng.random() < args.load / 4 for _ in range(trials))
        for _ in range(min(arrivals, len(pending))):
            tokens, hashes = pending.popleft()
            c = sent % coordinators
            sent += 1
            loads = [
                RankLoad(i, stats[i][0] + bumps[c][i], stats[i][1], True) for i in range(args.ranks)
            ]
            chosen = policies[c].choose(tokens, loads)
            bumps[c][chosen] += 1
            job = Job(tokens, hashes, now, rng.randint(2, 6))
            hits += ranks[chosen].admit(job)
            blocks += len(hashes)
        for r in ranks:
            r.tick(now, delays)
        now += 1
    return hits / blocks, statistics.fmean(delays)


def cost_us(policy_name: str, prompt_tokens: int, calls: int) -> float:
    """Median CPU microseconds of one ``choose`` for a prompt of ``prompt_tokens``, 8 ranks."""
    policy = make_policy(policy_name, BS)
    loads = [RankLoad(i, 0, 0, True) for i in range(8)]
    times = []
    for n in range(calls):
        tokens = [n * 1_000_000 + i for i in range(prompt_tokens)]
        start = time.perf_counter()
        policy.choose(tokens, loads)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--coordinators", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--slots", type=int, default=4, help="requests running at once per rank")
    parser.add_argument("--cache-blocks", type=int, default=1_500, help="prefix cache per rank")
    parser.add_argument("--groups", type=int, default=96, help="shared prefixes")
    parser.add_argument("--shared-blocks", type=int, default=64, help="blocks per shared prefix")
    parser.add_argument("--requests", type=int, default=6_000)
    parser.add_argument("--load", type=float, default=0.8, help="fraction of fleet capacity")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    print("| policy | coordinators | prefix-cache hits | mean queueing (ticks) |")
    print("|---|---:|---:|---:|")
    for name in POLICIES:
        for c in args.coordinators:
            hit_rate, delay = simulate(name, c, args)
            print(f"| {name} | {c} | {hit_rate:.1%} | {delay:.2f} |")
    print()
    print("| policy | choose(), 2k-token prompt | choose(), 100k-token prompt |")
    print("|---|---:|---:|")
    for name in POLICIES:
        short, long = cost_us(name, 2_000, 200), cost_us(name, 100_000, 30)
        print(f"| {name} | {short:,.0f} µs | {long:,.0f} µs |")


if __name__ == "__main__":
    main()
