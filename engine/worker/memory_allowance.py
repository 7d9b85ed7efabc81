"""How much memory this process may still take: the smaller of its cgroup's headroom and the
kernel's ``MemAvailable``.

A machine's free memory says nothing about a container's share of it: a pod's cgroup has its
own limit (``memory.max`` on cgroup v2, ``memory.limit_in_bytes`` on v1), and the OOM killer
acts on it whatever the node has free. Outside any limit, ``MemAvailable`` (``/proc/meminfo``)
is the kernel's estimate of what can be allocated without swapping, page cache that can be
dropped included. The headroom under a limit is the limit minus the cgroup's working set:
its usage less its inactive file pages (``inactive_file`` in ``memory.stat``), which the kernel
reclaims before it kills anything; the kubelet measures the working set the same way.

Every ancestor's limit applies too (a pod's cgroup under its QoS slice), hence the walk up to
the root; the tightest headroom counts. No torch here: ``corefleet serve`` reads it before it
starts its ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
PROC_MEMINFO = Path("/proc/meminfo")

# cgroup v1 writes "no limit" as the largest page-aligned signed 64-bit number (or close to it).
_V1_NO_LIMIT = 1 << 62
GiB = 1 << 30


@dataclass(frozen=True)
class CgroupMemory:
    """One cgroup's memory limit and working set, in bytes."""

    path: Path  # the cgroup directory the figures come from
    limit: int
    working_set: int  # usage less inactive file pages

    @property
    def headroom(self) -> int:
        return max(0, self.limit - self.working_set)


@dataclass(frozen=True)
class MemoryAllowance:
    """What this process may still allocate, each source kept for the log and for refusals."""

    mem_available: int | None  # /proc/meminfo MemAvailable; None = unreadable
    cgroup: CgroupMemory | None  # the tightest limited cgroup; None = no limit

    @property
    def free(self) -> int | None:
        """Bytes: the smaller of ``MemAvailable`` and the cgroup's headroom; None if neither
        could be read (then nothing is known, and nothing is assumed)."""
        figures = [self.mem_available, self.cgroup.headroom if self.cgroup else None]
        known = [f for f in figures if f is not None]
        return min(known) if known else None

    def sources(self) -> str:
        """``"MemAvailable 21.30 GiB; cgroup limit 6.00 GiB, working set 0.40 GiB"``."""
        available = "unknown" if self.mem_available is None else _gib(self.mem_available)
        if self.cgroup is None:
            limit = "cgroup limit none"
        else:
            limit = (
                f"cgroup limit {_gib(self.cgroup.limit)}, working set "
                f"{_gib(self.cgroup.working_set)}"
            )
        return f"MemAvailable {available}; {limit}"


def _gib(value: int) -> str:
    return f"{value / GiB:.2f} GiB"


def mem_available(meminfo: Path = PROC_MEMINFO) -> int | None:
    """``MemAvailable`` in bytes (the file gives kB); None if the file or the line is missing."""
    try:
        lines = meminfo.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, rest = line.partition(":")
        if name == "MemAvailable":
            fields = rest.split()
            try:
                return int(fields[0]) * 1024
            except (IndexError, ValueError):
                return None
    return None


def cgroup_memory(
    cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_SELF_CGROUP
) -> CgroupMemory | None:
    """The tightest memory limit over this process's cgroup and its ancestors (v2, else v1);
    None without one."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    # cgroup v2 has the single line "0::/path"; v1 controllers have "N:controllers:/path".
    v2_path = next((line[3:] for line in lines if line.startswith("0::")), None)
    if v2_path is not None:
        found = _tightest(cgroup_root, v2_path, _v2_figures)
        if found is not None:
            return found
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3 and "memory" in parts[1].split(","):
            return _tightest(cgroup_root / "memory", parts[2], _v1_figures)
    return None


def _tightest(
    root: Path, path: str, figures: Callable[[Path], CgroupMemory | None]
) -> CgroupMemory | None:
    root = root.resolve()
    directory = (root / path.lstrip("/")).resolve()
    best: CgroupMemory | None = None
    while True:
        found = figures(directory)
        if found is not None and (best is None or found.headroom < best.headroom):
            best = found
        if directory == root or root not in directory.parents:
            return best
        directory = directory.parent


def _v2_figures(directory: Path) -> CgroupMemory | None:
    limit = _read_int(directory / "memory.max")  # "max": no limit, read as None
    usage = _read_int(directory / "memory.current")
    if limit is None or usage is None:
        return None
    inactive = _stat(directory / "memory.stat", "inactive_file")
    return CgroupMemory(directory, limit, max(0, usage - inactive))


def _v1_figures(directory: Path) -> CgroupMemory | None:
    limit = _read_int(directory / "memory.limit_in_bytes")
    usage = _read_int(directory / "memory.usage_in_bytes")
    if limit is None or usage is None or limit >= _V1_NO_LIMIT:
        return None
    inactive = _stat(directory / "memory.stat", "total_inactive_file")
    return CgroupMemory(directory, limit, max(0, usage - inactive))


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):  # missing, or "max"
        return None


def _stat(path: Path, key: str) -> int:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        name, _, value = line.partition(" ")
        if name == key:
            try:
                return int(value)
            except ValueError:
                return 0
    return 0


def read_memory_allowance(
    cgroup_root: Path = CGROUP_ROOT,
    proc_cgroup: Path = PROC_SELF_CGROUP,
    meminfo: Path = PROC_MEMINFO,
) -> MemoryAllowance:
    """This process's allowance now."""
    return MemoryAllowance(mem_available(meminfo), cgroup_memory(cgroup_root, proc_cgroup))
