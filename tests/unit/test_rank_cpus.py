"""``corefleet serve``'s cores per local rank: disjoint blocks, explicit sets, sharing, refusal."""

from __future__ import annotations

import os

import pytest

from corefleet.engine.cli import parse_args
from corefleet.engine.entrypoints.rank_cpus import (
    RankCpus,
    parse_cpu_sets,
    plan_from_args,
    plan_rank_cpus,
)
from corefleet.engine.worker.cpu_allowance import CpuAllowance


def cores(n: int, quota: int | None = None, threads: int | None = None) -> CpuAllowance:
    return CpuAllowance(tuple(range(n)), quota, None, threads)


def cpus_of(plan: list[RankCpus]) -> list[tuple[int, ...]]:
    return [r.cpus for r in plan]


def test_ranks_get_disjoint_contiguous_blocks() -> None:
    assert cpus_of(plan_rank_cpus(2, cores(2))) == [(0,), (1,)]
    assert cpus_of(plan_rank_cpus(2, cores(4))) == [(0, 1), (2, 3)]
    assert cpus_of(plan_rank_cpus(3, cores(5))) == [(0, 1), (2, 3), (4,)]
    assert cpus_of(plan_rank_cpus(1, cores(8))) == [tuple(range(8))]
    # ranks on their own cores size their threads from them
    assert all(r.threads is None for r in plan_rank_cpus(2, cores(4)))
    # a non-contiguous affinity (taskset -c 0,2,5,7) is cut the same way
    odd = CpuAllowance((0, 2, 5, 7), None, None)
    assert cpus_of(plan_rank_cpus(2, odd)) == [(0, 2), (5, 7)]


def test_more_ranks_than_cores_is_refused_unless_sharing() -> None:
    with pytest.raises(ValueError) as err:
        plan_rank_cpus(3, cores(2))
    message = str(err.value)
    assert "--data-parallel-size 3 needs 3 cores" in message
    assert "may use 2 (affinity 0-1; cgroup quota none; request none)" in message
    assert "--share-cores" in message
    shared = plan_rank_cpus(3, cores(2), share=True)
    assert cpus_of(shared) == [(0, 1)] * 3
    assert [r.threads for r in shared] == [1, 1, 1]
    assert [r.threads for r in plan_rank_cpus(2, cores(4), share=True)] == [2, 2]


def test_a_quota_below_the_affinity_is_split_between_the_ranks() -> None:
    plan = plan_rank_cpus(2, cores(8, quota=4))
    assert cpus_of(plan) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert [r.threads for r in plan] == [2, 2]
    with pytest.raises(ValueError, match=r"may use 4 .*cgroup quota 4 cores"):
        plan_rank_cpus(5, cores(8, quota=4))


def test_explicit_sets() -> None:
    assert parse_cpu_sets("0-1;2-3") == [(0, 1), (2, 3)]
    plan = plan_rank_cpus(2, cores(4), parse_cpu_sets("3;0-1"))
    assert cpus_of(plan) == [(3,), (0, 1)]
    with pytest.raises(ValueError, match="gives 1 core sets for --data-parallel-size 2"):
        plan_rank_cpus(2, cores(4), parse_cpu_sets("0-1"))
    with pytest.raises(ValueError, match=r"rank 1's cores 4-5 do not fit .* affinity 0-3"):
        plan_rank_cpus(2, cores(4), parse_cpu_sets("0;4-5"))
    with pytest.raises(ValueError, match="core 1 is in the sets of ranks 0 and 1"):
        plan_rank_cpus(2, cores(4), parse_cpu_sets("0-1;1-2"))
    overlapping = plan_rank_cpus(2, cores(4), parse_cpu_sets("0-1;1-2"), share=True)
    assert cpus_of(overlapping) == [(0, 1), (1, 2)]
    assert [r.threads for r in overlapping] == [2, 2]


def test_explicit_threads_must_fit_a_rank() -> None:
    with pytest.raises(
        ValueError, match="COREFLEET_CPU_THREADS=2 does not fit a rank's share of 1"
    ):
        plan_rank_cpus(2, cores(2, threads=2))
    plan = plan_rank_cpus(2, cores(4, threads=2))
    assert [r.threads for r in plan] == [None, None]  # inherited from the environment


def test_rank_flags_and_environment() -> None:
    rank = RankCpus((0, 1, 3), threads=None)
    assert rank.argv() == ["--cpu-set", "0-1,3"]
    assert rank.env({"A": "b"}) is None
    assert RankCpus((0, 1), threads=1).env({"A": "b"}) == {"A": "b", "COREFLEET_CPU_THREADS": "1"}


def test_serve_flags_reach_the_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COREFLEET_CPU_THREADS", raising=False)
    monkeypatch.delenv("COREFLEET_CPU_REQUEST_MILLICORES", raising=False)
    affinity = sorted(os.sched_getaffinity(0))
    first = str(affinity[0])
    args = parse_args(["serve", "--rank-cpu-sets", first])
    assert cpus_of(plan_from_args(args)) == [(affinity[0],)]
    args = parse_args(["serve", "--data-parallel-size", str(len(affinity) + 1)])
    with pytest.raises(ValueError, match="--share-cores"):
        plan_from_args(args)
    args = parse_args(["serve", "--data-parallel-size", str(len(affinity) + 1), "--share-cores"])
    assert len(plan_from_args(args)) == len(affinity) + 1
