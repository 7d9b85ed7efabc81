"""The CPU allowance: affinity, cgroup v2 quota (a fake cgroup tree), pod request, and the
refusal of a thread count or core set that does not fit."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from corefleet.engine import envs
from corefleet.engine.worker.cpu_allowance import (
    CpuAllowance,
    apply_cpu_set,
    cgroup_quota_cores,
    format_cpu_list,
    parse_cpu_list,
    read_allowance,
    request_cores,
)
from corefleet.engine.worker.devices import set_cpu_threads

AFFINITY = tuple(sorted(os.sched_getaffinity(0)))


def fake_cgroup(tmp_path: Path, path: str, cpu_max: dict[str, str]) -> tuple[Path, Path]:
    """A cgroup v2 root with ``cpu.max`` files at the given relative folders, and a
    /proc/self/cgroup naming ``path``."""
    root = tmp_path / "cgroup"
    (root / path.lstrip("/")).mkdir(parents=True)
    for folder, content in cpu_max.items():
        (root / folder / "cpu.max").write_text(content + "\n")
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text(f"0::{path}\n")
    return root, proc


@pytest.fixture
def restore_affinity() -> Iterator[None]:
    before = os.sched_getaffinity(0)
    yield
    os.sched_setaffinity(0, before)


def test_cpu_lists_parse_and_format_both_ways() -> None:
    assert parse_cpu_list("0-1,4, 6-7") == (0, 1, 4, 6, 7)
    assert parse_cpu_list("3") == (3,)
    assert format_cpu_list([7, 6, 4, 1, 0]) == "0-1,4,6-7"
    assert format_cpu_list([5]) == "5"
    for bad in ("", "a", "3-1", "-1", "0-"):
        with pytest.raises(ValueError, match="invalid CPU list"):
            parse_cpu_list(bad)


def test_quota_is_rounded_up_and_the_tightest_ancestor_wins(tmp_path: Path) -> None:
    root, proc = fake_cgroup(tmp_path, "/kubepods/pod1/c1", {"kubepods/pod1/c1": "150000 100000"})
    assert cgroup_quota_cores(root, proc) == 2
    (root / "kubepods" / "cpu.max").write_text("100000 100000\n")  # a tighter parent applies
    assert cgroup_quota_cores(root, proc) == 1
    (root / "kubepods" / "pod1" / "cpu.max").write_text("20000 100000\n")  # 0.2: one thread
    assert cgroup_quota_cores(root, proc) == 1


def test_no_quota_reads_as_none(tmp_path: Path) -> None:
    root, proc = fake_cgroup(tmp_path, "/a/b", {"a/b": "max 100000", "a": "max 100000"})
    assert cgroup_quota_cores(root, proc) is None
    # cgroup v1 only (no "0::" line), or no cgroup files at all
    proc.write_text("4:cpu,cpuacct:/a/b\n")
    assert cgroup_quota_cores(root, proc) is None
    assert cgroup_quota_cores(tmp_path / "missing", tmp_path / "missing-proc") is None


def test_container_namespace_root_quota(tmp_path: Path) -> None:
    # Inside a cgroup namespace the container is "/" and its cpu.max is at the root.
    root, proc = fake_cgroup(tmp_path, "/", {"": "300000 100000"})
    assert cgroup_quota_cores(root, proc) == 3


def test_request_is_rounded_down_to_whole_cores() -> None:
    assert request_cores(0) is None
    assert request_cores(250) == 1
    assert request_cores(1999) == 1
    assert request_cores(4000) == 4
    with pytest.raises(ValueError):
        request_cores(-1)


def test_allowance_is_the_smallest_source(tmp_path: Path) -> None:
    root, proc = fake_cgroup(tmp_path, "/c", {"c": "max 100000"})
    allowance = read_allowance(0, 0, root, proc)
    assert allowance.affinity == AFFINITY
    assert allowance.threads == allowance.cores == len(AFFINITY)
    assert allowance.describe() == (
        f"{len(AFFINITY)} threads (affinity {format_cpu_list(AFFINITY)}; cgroup quota none; "
        "request none)"
    )
    (root / "c" / "cpu.max").write_text("100000 100000\n")
    assert read_allowance(0, 0, root, proc).threads == 1
    one = CpuAllowance(affinity=(0, 1, 2, 3), quota_cores=3, request_cores=2)
    assert one.cores == 2 and "request 2 cores" in one.describe()


def test_explicit_threads_must_fit(tmp_path: Path) -> None:
    root, proc = fake_cgroup(tmp_path, "/c", {"c": "max 100000"})
    assert read_allowance(1, 0, root, proc).threads == 1
    too_many = len(AFFINITY) + 1
    with pytest.raises(ValueError) as err:
        read_allowance(too_many, 0, root, proc)
    message = str(err.value)
    assert f"COREFLEET_CPU_THREADS={too_many}" in message
    assert f"allowance of {len(AFFINITY)} cores" in message
    assert f"affinity {format_cpu_list(AFFINITY)}" in message
    # a pod request below the explicit count refuses it too
    if len(AFFINITY) >= 2:
        with pytest.raises(ValueError, match="request 1 cores"):
            read_allowance(2, 1000, root, proc)


def test_envs_read_the_request_and_refuse_garbage(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COREFLEET_CPU_REQUEST_MILLICORES", "2500")
    assert envs.cpu_request_millicores() == 2500
    monkeypatch.setenv("COREFLEET_CPU_REQUEST_MILLICORES", "2")  # not "2 cores": millicores
    assert envs.cpu_request_millicores() == 2
    monkeypatch.setenv("COREFLEET_CPU_REQUEST_MILLICORES", "2.5")
    with pytest.raises(ValueError, match="not an integer"):
        envs.cpu_request_millicores()
    monkeypatch.setenv("COREFLEET_CPU_THREADS", "-1")
    with pytest.raises(ValueError, match=">= 0"):
        envs.cpu_threads()


def test_cpu_set_pins_this_process(restore_affinity: None) -> None:
    target = AFFINITY[-1]
    assert apply_cpu_set([target]) == (target,)
    assert os.sched_getaffinity(0) == {target}


def test_cpu_set_outside_the_affinity_is_refused_naming_both(restore_affinity: None) -> None:
    outside = max(AFFINITY) + 1
    with pytest.raises(ValueError) as err:
        apply_cpu_set([outside])
    assert f"--cpu-set {outside} does not fit" in str(err.value)
    assert f"affinity {format_cpu_list(AFFINITY)}" in str(err.value)
    assert os.sched_getaffinity(0) == set(AFFINITY)
    with pytest.raises(ValueError, match="--cpu-set \\(empty\\)"):
        apply_cpu_set([])


def test_executor_sizes_torch_threads_from_the_allowance(monkeypatch: pytest.MonkeyPatch) -> None:
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("COREFLEET_CPU_THREADS", "1")
        set_cpu_threads()
        assert torch.get_num_threads() == 1
        monkeypatch.delenv("COREFLEET_CPU_THREADS")
        monkeypatch.delenv("COREFLEET_CPU_REQUEST_MILLICORES", raising=False)
        set_cpu_threads()
        assert torch.get_num_threads() == read_allowance().threads
        monkeypatch.setenv("COREFLEET_CPU_THREADS", str(len(AFFINITY) + 1))
        with pytest.raises(ValueError, match="does not fit"):
            set_cpu_threads()
    finally:
        torch.set_num_threads(before)
