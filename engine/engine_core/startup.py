"""How long a rank's start took, phase by phase, logged as one line when it is ready.

A new rank pod must be ready fast (an autoscaler waits for it), and the next regression of the
start time must show where it is: in the imports, the handshake, the model (kernel build and
weights), the KV cache or the final hand-over. Times are wall clock, from the process's own
start as the kernel recorded it, so the interpreter's start and the imports are counted too.
"""

from __future__ import annotations

import logging
import os
import time

logger = logging.getLogger(__name__)


def process_age_s() -> float:
    """Seconds since this process started (0.0 where /proc cannot tell)."""
    try:
        with open("/proc/self/stat", encoding="ascii") as stat:
            # Field 22 (starttime, clock ticks after boot) follows the command name, which is
            # in parentheses and may itself contain spaces: split after its closing one.
            fields = stat.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime", encoding="ascii") as uptime:
            now_s = float(uptime.read().split()[0])
        return max(0.0, now_s - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


class StartupClock:
    """Phase times of one start: call :meth:`phase` at the end of each phase, in order."""

    def __init__(self) -> None:
        self._last = time.monotonic()
        self.phases: list[tuple[str, float]] = [("imports", process_age_s())]

    def phase(self, name: str) -> None:
        """Record that phase ``name`` ended now."""
        now = time.monotonic()
        self.phases.append((name, now - self._last))
        self._last = now

    @property
    def total_s(self) -> float:
        return sum(seconds for _, seconds in self.phases)

    def report(self, rank: int) -> None:
        """Log ``rank 0: ready 12.3 s after process start: imports 2.1 s, ...``."""
        parts = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.phases)
        logger.info("rank %d: ready %.1f s after process start: %s", rank, self.total_s, parts)
