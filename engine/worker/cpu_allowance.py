"""How many cores this process may use: the size of torch's thread pool on CPU.

A machine's core count says nothing about a process's share of it: ``taskset`` or
``corefleet serve`` narrow its affinity, a container's cgroup caps its CPU time (``cpu.max``),
and a pod is only promised its CPU request. One thread per core of the node, on a share of two,
puts every thread of a parallel region behind another (the collapse next to a busy neighbour
of issue 19). The allowance is the smallest of the three; an explicit thread count must fit it.

No torch here: ``corefleet serve`` (which never imports torch) plans its ranks' cores with it,
and a rank applies its core set before torch starts any thread.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """``"0-1,4"`` (the kernel's cpu list format, as in ``taskset -c``) -> ``(0, 1, 4)``."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        first, dash, last = part.partition("-")
        try:
            low = int(first)
            high = int(last) if dash else low
        except ValueError:
            raise ValueError(
                f"invalid CPU list {text!r}: expected core numbers and ranges like 0-3,6"
            ) from None
        if low < 0 or high < low:
            raise ValueError(f"invalid CPU list {text!r}: range {part!r} is empty or negative")
        cpus.update(range(low, high + 1))
    return tuple(sorted(cpus))


def format_cpu_list(cpus: Iterable[int]) -> str:
    """``(0, 1, 4)`` -> ``"0-1,4"``; the inverse of :func:`parse_cpu_list`."""
    ranges: list[str] = []
    ordered = sorted(set(cpus))
    start = 0
    for i in range(1, len(ordered) + 1):
        if i == len(ordered) or ordered[i] != ordered[i - 1] + 1:
            low, high = ordered[start], ordered[i - 1]
            ranges.append(str(low) if low == high else f"{low}-{high}")
            start = i
    return ",".join(ranges)


def cgroup_quota_cores(
    cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_SELF_CGROUP
) -> int | None:
    """Cores the cgroup v2 ``cpu.max`` quota allows this process: ``ceil(quota / period)`` of
    the tightest quota from its cgroup up to the root; None without one (``max``, cgroup v1, or
    no cgroup file system).

    Every ancestor's quota applies too (a pod's cgroup under a limited QoS slice), hence the walk.
    """
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    # cgroup v2 has the single line "0::/path"; v1 controllers have "N:controllers:/path".
    path = next((line[3:] for line in lines if line.startswith("0::")), None)
    if path is None:
        return None
    root = cgroup_root.resolve()
    directory = (root / path.lstrip("/")).resolve()
    best: int | None = None
    while True:
        cores = _cpu_max_cores(directory / "cpu.max")
        if cores is not None:
            best = cores if best is None else min(best, cores)
        if directory == root or root not in directory.parents:
            return best
        directory = directory.parent


def _cpu_max_cores(path: Path) -> int | None:
    try:
        fields = path.read_text().split()
    except OSError:
        return None
    if len(fields) != 2 or fields[0] == "max":
        return None
    try:
        quota, period = int(fields[0]), int(fields[1])
    except ValueError:
        return None
    if quota <= 0 or period <= 0:
        return None
    return max(1, math.ceil(quota / period))


def request_cores(millicores: int) -> int | None:
    """Whole cores a pod's CPU request promises: ``floor(millicores / 1000)``, at least 1;
    None for 0 (no request: the downward API then reports 0).

    Rounded down, unlike the quota: the request is the share the node guarantees under
    contention, and a thread without a whole guaranteed core under it is the one a busy
    neighbour stalls, holding up every other thread of the parallel region.
    """
    if millicores < 0:
        raise ValueError(f"the CPU request {millicores}m must be >= 0")
    if millicores == 0:
        return None
    return max(1, millicores // 1000)


@dataclass(frozen=True)
class CpuAllowance:
    """What this process may use, each source recorded so the choice can be logged and refused
    with the reason."""

    affinity: tuple[int, ...]  # sched_getaffinity: the cores the kernel lets us run on
    quota_cores: int | None  # cgroup v2 cpu.max, rounded up; None = no quota
    request_cores: int | None  # the pod's CPU request, rounded down; None = not in a pod / none
    explicit_threads: int | None = None  # COREFLEET_CPU_THREADS; None = sized from the rest

    @property
    def cores(self) -> int:
        """The smallest of the affinity, the quota and the request (at least 1)."""
        limits = [len(self.affinity), self.quota_cores, self.request_cores]
        return max(1, min(n for n in limits if n is not None))

    @property
    def threads(self) -> int:
        """torch's intra-op threads: the explicit count, else one per allowed core."""
        return self.explicit_threads or self.cores

    def sources(self) -> str:
        """``"affinity 0-1; cgroup quota none; request none"``."""
        quota = "none" if self.quota_cores is None else f"{self.quota_cores} cores"
        request = "none" if self.request_cores is None else f"{self.request_cores} cores"
        return f"affinity {format_cpu_list(self.affinity)}; cgroup quota {quota}; request {request}"

    def describe(self) -> str:
        """``"2 threads (affinity 0-1; cgroup quota none; request none)"``, for the start log."""
        explicit = "COREFLEET_CPU_THREADS; " if self.explicit_threads else ""
        return f"{self.threads} threads ({explicit}{self.sources()})"

    def check(self) -> None:
        """Refuse an explicit thread count the allowance cannot hold, naming both."""
        if self.explicit_threads is not None and self.explicit_threads > self.cores:
            raise ValueError(
                f"COREFLEET_CPU_THREADS={self.explicit_threads} does not fit this process's CPU "
                f"allowance of {self.cores} cores ({self.sources()}); set it to "
                f"{self.cores} or less, or unset it to size the threads from the allowance"
            )


def read_allowance(
    explicit_threads: int = 0,
    request_millicores: int = 0,
    cgroup_root: Path = CGROUP_ROOT,
    proc_cgroup: Path = PROC_SELF_CGROUP,
) -> CpuAllowance:
    """This process's allowance now (after any :func:`apply_cpu_set`), checked.

    ``explicit_threads`` and ``request_millicores`` come from ``envs`` (0 = not set); a thread
    count that does not fit raises ``ValueError``.
    """
    if explicit_threads < 0:
        raise ValueError(f"COREFLEET_CPU_THREADS={explicit_threads} must be >= 0")
    allowance = CpuAllowance(
        affinity=tuple(sorted(os.sched_getaffinity(0))),
        quota_cores=cgroup_quota_cores(cgroup_root, proc_cgroup),
        request_cores=request_cores(request_millicores),
        explicit_threads=explicit_threads or None,
    )
    allowance.check()
    return allowance


def apply_cpu_set(cpus: Iterable[int]) -> tuple[int, ...]:
    """Pin this process (every thread started from now on) to ``cpus``; returns them sorted.

    Only a subset of the current affinity fits: a rank never widens what its parent, ``taskset``
    or the container's cpuset gave it. Call it before torch starts its thread pool, which sizes
    itself and places its threads when it starts.
    """
    wanted = tuple(sorted(set(cpus)))
    current = os.sched_getaffinity(0)
    if not wanted or not set(wanted) <= current:
        raise ValueError(
            f"--cpu-set {format_cpu_list(wanted) or '(empty)'} does not fit this process's CPU "
            f"affinity {format_cpu_list(current)}; choose cores from it"
        )
    os.sched_setaffinity(0, wanted)
    return wanted
