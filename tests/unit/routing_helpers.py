"""Rank loads and prompts for the routing policies' tests."""

from __future__ import annotations

from corefleet.engine.coordinator.routing import RankLoad

BS = 16  # the block size the routing tests hash prompts in


def idle(n: int) -> list[RankLoad]:
    return [RankLoad(rank=i, waiting=0, running=0, accepting=True) for i in range(n)]


def with_load(
    ranks: list[RankLoad], rank: int, *, waiting: int = 0, running: int = 0, accepting: bool = True
) -> list[RankLoad]:
    return [RankLoad(rank, waiting, running, accepting) if r.rank == rank else r for r in ranks]


def prompt(seed: int, blocks: int, extra: int = 0) -> list[int]:
    """``blocks`` full blocks plus ``extra`` tokens, distinct per seed."""
    return [seed * 100_000 + i for i in range(blocks * BS + extra)]
