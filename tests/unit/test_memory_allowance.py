"""The memory a process may still take: cgroup v2 and v1 limits (walked up to the root), their
working set, ``MemAvailable``, and every file missing or saying "no limit"."""

from __future__ import annotations

from pathlib import Path

from corefleet.engine.worker.memory_allowance import (
    CgroupMemory,
    MemoryAllowance,
    cgroup_memory,
    mem_available,
    read_memory_allowance,
)

MiB = 1 << 20
GiB = 1 << 30


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _meminfo(tmp_path: Path, available_kb: int) -> Path:
    path = tmp_path / "meminfo"
    _write(
        path,
        f"MemTotal:       24000000 kB\nMemFree:         1000000 kB\n"
        f"MemAvailable:   {available_kb} kB\nBuffers:          100 kB\n",
    )
    return path


def _v2_cgroup(directory: Path, limit: str, current: int, inactive_file: int = 0) -> None:
    _write(directory / "memory.max", f"{limit}\n")
    _write(directory / "memory.current", f"{current}\n")
    _write(directory / "memory.stat", f"anon 123\ninactive_file {inactive_file}\nactive_file 9\n")


def test_mem_available_reads_kilobytes(tmp_path: Path) -> None:
    assert mem_available(_meminfo(tmp_path, 2048)) == 2048 * 1024
    assert mem_available(tmp_path / "missing") is None
    _write(tmp_path / "no_line", "MemTotal: 5 kB\n")
    assert mem_available(tmp_path / "no_line") is None


def test_v2_limit_minus_working_set(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    _v2_cgroup(root / "kubepods" / "pod1", str(6 * GiB), 2 * GiB, inactive_file=GiB)
    proc = tmp_path / "proc_cgroup"
    _write(proc, "0::/kubepods/pod1\n")
    found = cgroup_memory(root, proc)
    assert found == CgroupMemory((root / "kubepods" / "pod1").resolve(), 6 * GiB, GiB)
    assert found.headroom == 5 * GiB  # inactive file pages are reclaimed before an OOM kill


def test_v2_max_means_no_limit_and_an_ancestor_can_be_tighter(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    proc = tmp_path / "proc_cgroup"
    _write(proc, "0::/slice/pod\n")
    _v2_cgroup(root / "slice" / "pod", "max", 3 * GiB)
    assert cgroup_memory(root, proc) is None  # "max" everywhere: no limit
    _v2_cgroup(root / "slice", str(4 * GiB), 3 * GiB + 512 * MiB)  # the QoS slice's limit
    found = cgroup_memory(root, proc)
    assert found is not None and found.headroom == 512 * MiB
    assert found.path == (root / "slice").resolve()
    _v2_cgroup(root / "slice" / "pod", str(8 * GiB), 3 * GiB)  # looser than the slice
    found = cgroup_memory(root, proc)
    assert found is not None and found.headroom == 512 * MiB


def test_v1_limit_and_its_no_limit_value(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    proc = tmp_path / "proc_cgroup"
    _write(proc, "5:cpu,cpuacct:/x\n4:memory:/docker/abc\n0::/\n")
    pod = root / "memory" / "docker" / "abc"
    _write(pod / "memory.limit_in_bytes", str(2 * GiB))
    _write(pod / "memory.usage_in_bytes", str(GiB))
    _write(pod / "memory.stat", f"cache 5\ntotal_inactive_file {256 * MiB}\n")
    found = cgroup_memory(root, proc)
    assert found is not None and found.headroom == GiB + 256 * MiB
    _write(pod / "memory.limit_in_bytes", "9223372036854771712")  # v1's "no limit"
    assert cgroup_memory(root, proc) is None


def test_v1_path_missing_under_the_mount_falls_back_to_its_root(tmp_path: Path) -> None:
    # Docker without a cgroup namespace: /proc/self/cgroup names the host's path, while the
    # container's own cgroup is mounted as the root.
    root = tmp_path / "cgroup"
    proc = tmp_path / "proc_cgroup"
    _write(proc, "4:memory:/process_api/abc\n")
    _write(root / "memory" / "memory.limit_in_bytes", str(GiB))
    _write(root / "memory" / "memory.usage_in_bytes", str(256 * MiB))
    found = cgroup_memory(root, proc)
    assert found is not None and found.headroom == 768 * MiB


def test_missing_files_mean_no_limit(tmp_path: Path) -> None:
    assert cgroup_memory(tmp_path / "none", tmp_path / "no_proc_cgroup") is None
    proc = tmp_path / "proc_cgroup"
    _write(proc, "0::/a\n")
    assert cgroup_memory(tmp_path / "empty_root", proc) is None
    _write(tmp_path / "cg" / "a" / "memory.max", str(GiB))  # no memory.current: unreadable
    assert cgroup_memory(tmp_path / "cg", proc) is None


def test_free_is_the_smaller_of_the_two(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    proc = tmp_path / "proc_cgroup"
    _write(proc, "0::/pod\n")
    _v2_cgroup(root / "pod", str(2 * GiB), GiB)
    allowance = read_memory_allowance(root, proc, _meminfo(tmp_path, 8 * 1024 * 1024))
    assert allowance.free == GiB  # the cgroup's headroom, below 8 GiB available
    assert allowance.sources() == (
        "MemAvailable 8.00 GiB; cgroup limit 2.00 GiB, working set 1.00 GiB"
    )
    tight = read_memory_allowance(root, proc, _meminfo(tmp_path, 512 * 1024))
    assert tight.free == 512 * MiB  # a crowded node: less available than the limit allows
    assert MemoryAllowance(None, None).free is None
    assert MemoryAllowance(3 * GiB, None).sources() == "MemAvailable 3.00 GiB; cgroup limit none"
