"""Which cores each of ``corefleet serve``'s local ranks runs on, and with how many threads.

Each rank gets its own disjoint set of the coordinator's cores, passed as ``engine-core
--cpu-set`` (the rank pins itself before torch starts its threads, so its pool is sized from
and placed on its own cores; vLLM's CPU backend binds its OpenMP threads the same way). Ranks
that overlapped would each run a thread per shared core and stall each other's parallel regions.

The coordinator itself is not given a core of its own: it is HTTP, routing and detokenization,
mostly waiting on sockets, and a whole core reserved for it would sit idle while costing a rank
(on 2 cores, the second rank). It keeps the full affinity, and the kernel fits its short bursts
in between the ranks' threads.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from corefleet.engine import envs
from corefleet.engine.worker.cpu_allowance import (
    CpuAllowance,
    format_cpu_list,
    parse_cpu_list,
    read_allowance,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankCpus:
    """One local rank's cores, and its thread count where it must not size itself."""

    cpus: tuple[int, ...]
    # None: the rank sizes its threads from its allowance (one per core of ``cpus``). Set when
    # ranks share cores, or the coordinator's quota/request is below its affinity: the rank
    # cannot know how many others share that budget.
    threads: int | None = None

    def argv(self) -> list[str]:
        """The ``engine-core`` flags that apply this."""
        return ["--cpu-set", format_cpu_list(self.cpus)]

    def env(self, base: dict[str, str]) -> dict[str, str] | None:
        """The rank's environment: ``base`` with its thread count; None = inherit unchanged."""
        if self.threads is None:
            return None
        return {**base, envs.CPU_THREADS: str(self.threads)}


def parse_cpu_sets(text: str) -> list[tuple[int, ...]]:
    """``--rank-cpu-sets "0-1;2-3"`` -> one core tuple per rank."""
    return [parse_cpu_list(part) for part in text.split(";")]


def plan_rank_cpus(
    count: int,
    allowance: CpuAllowance,
    explicit_sets: Sequence[Sequence[int]] | None = None,
    share: bool = False,
) -> list[RankCpus]:
    """Cores for ``count`` ranks within the coordinator's ``allowance``.

    Without ``explicit_sets`` the affinity is cut into ``count`` contiguous, disjoint blocks
    (the remainder to the first ranks). ``count`` above the allowance's cores is refused unless
    ``share``: then every rank gets every core and ``cores // count`` threads (at least 1). A
    ``COREFLEET_CPU_THREADS`` in the allowance is inherited by every rank, so it must fit one
    rank's share. Every refusal is a ``ValueError`` that names what was asked and what there is.
    """
    if count < 1:
        raise ValueError("--data-parallel-size must be at least 1")
    available = allowance.affinity
    budget = allowance.cores
    if count > budget and not share:
        raise ValueError(
            f"--data-parallel-size {count} needs {count} cores, one per rank, but this process "
            f"may use {budget} ({allowance.sources()}); run fewer ranks, or give --share-cores "
            "to run them all on the same cores (each slower, all sharing)"
        )
    if explicit_sets is not None:
        sets = _check_explicit(count, explicit_sets, available, share)
    elif share:
        sets = [available] * count
    else:
        size, extra = divmod(len(available), count)
        sets, start = [], 0
        for rank in range(count):
            end = start + size + (1 if rank < extra else 0)
            sets.append(available[start:end])
            start = end
    # Ranks on shared cores, or a quota/request tighter than the affinity, split the budget.
    shared = share or budget < len(available)
    threads = max(1, budget // count) if shared else None
    explicit = allowance.explicit_threads
    if explicit is not None:
        # Ranks on their own cores check it against those; ranks sharing a budget against
        # their part of it (a rank alone cannot see the others); ranks asked to share, against
        # all of it, as each rank will.
        if not shared:
            limit = min(len(s) for s in sets)
        else:
            limit = budget if share else max(1, budget // count)
        if explicit > limit:
            raise ValueError(
                f"COREFLEET_CPU_THREADS={explicit} does not fit a rank's share of {limit} cores "
                f"({count} ranks over {allowance.sources()}); set it to {limit} or less, or "
                "unset it"
            )
        return [RankCpus(tuple(s)) for s in sets]  # the ranks inherit the explicit count
    return [RankCpus(tuple(s), None if threads is None else min(threads, len(s))) for s in sets]


def _check_explicit(
    count: int, explicit_sets: Sequence[Sequence[int]], available: Sequence[int], share: bool
) -> list[tuple[int, ...]]:
    if len(explicit_sets) != count:
        raise ValueError(
            f"--rank-cpu-sets gives {len(explicit_sets)} core sets for --data-parallel-size "
            f"{count}; give one per rank, separated by ';'"
        )
    sets = [tuple(sorted(set(s))) for s in explicit_sets]
    for rank, cpus in enumerate(sets):
        outside = set(cpus) - set(available)
        if not cpus or outside:
            raise ValueError(
                f"--rank-cpu-sets: rank {rank}'s cores {format_cpu_list(cpus) or '(none)'} do "
                f"not fit this process's CPU affinity {format_cpu_list(available)}"
            )
    if not share:
        seen: dict[int, int] = {}
        for rank, cpus in enumerate(sets):
            for cpu in cpus:
                if cpu in seen:
                    raise ValueError(
                        f"--rank-cpu-sets: core {cpu} is in the sets of ranks {seen[cpu]} and "
                        f"{rank}; make the sets disjoint, or give --share-cores"
                    )
                seen[cpu] = rank
    return sets


def add_rank_cpu_args(parser: argparse.ArgumentParser) -> None:
    """``serve``'s flags for its ranks' cores."""
    g = parser.add_argument_group("CPU cores of the local ranks")
    g.add_argument(
        "--rank-cpu-sets",
        default=None,
        metavar="SETS",
        help="each rank's cores, ranks separated by ';' (e.g. '0-1;2-3'); default: the "
        "cores this process may use, cut into one disjoint block per rank",
    )
    g.add_argument(
        "--share-cores",
        action="store_true",
        help="allow more ranks than cores (or overlapping --rank-cpu-sets): every rank runs on "
        "all its cores with cores/ranks threads; each rank is slower",
    )


def plan_from_args(args: argparse.Namespace) -> list[RankCpus]:
    """:func:`plan_rank_cpus` for ``serve``'s parsed flags and this process's allowance, logged."""
    allowance = read_allowance(envs.cpu_threads(), envs.cpu_request_millicores())
    explicit = parse_cpu_sets(args.rank_cpu_sets) if args.rank_cpu_sets else None
    plan = plan_rank_cpus(args.data_parallel_size, allowance, explicit, args.share_cores)
    for rank, cpus in enumerate(plan):
        logger.info(
            "rank %d: cores %s, %d threads%s (serve's allowance: %s)",
            rank,
            format_cpu_list(cpus.cpus),
            cpus.threads or allowance.explicit_threads or len(cpus.cpus),
            ", sharing them with the other ranks (--share-cores)" if args.share_cores else "",
            allowance.sources(),
        )
    return plan
