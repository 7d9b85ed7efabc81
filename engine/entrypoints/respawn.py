"""Local children watched, restarted when they die, stopped with their parent.

:class:`Respawner` watches a list of child processes: a child that exits is reported at once
(with its exit code or signal), also one that dies while starting, and is started again after a
back-off of 1 s, doubling up to 30 s, back to 1 s once a child served for a while. What "dead"
means for the fleet is the caller's business (a callback), as is "ready".
``corefleet serve`` uses one for its engine ranks and one for its API servers.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

from corefleet.engine.transport.handshake import describe_exit

logger = logging.getLogger(__name__)

# (index, pid, how it ended: "was killed by SIGKILL (exit code -9)")
ExitCallback = Callable[[int, int, str], None]
# (index, pid) -> whether that process serves now
ReadyProbe = Callable[[int, int], bool]
Spawn = Callable[[int], "subprocess.Popen[bytes]"]

POLL_S = 0.1  # how late a child's exit is noticed at worst
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
STABLE_AFTER_S = 60.0  # ready this long: the next death is a fresh failure, not a crash loop


@dataclass
class _Restarts:
    """One child's restart schedule."""

    backoff_s: float = FIRST_BACKOFF_S
    ready_since: float | None = None
    restart_at: float | None = None  # set while the child waits to be started again


class Respawner:
    """Watches ``procs`` (started by ``spawn(index)``) and restarts the ones that die."""

    def __init__(self, kind: str, procs: list[subprocess.Popen[bytes]], spawn: Spawn) -> None:
        self.kind = kind  # "engine rank", "API server": for the logs
        self.procs = procs
        self.spawn = spawn
        self.restarts = 0  # children started again after they died
        self.stopping = False

    async def supervise(
        self,
        on_exit: ExitCallback,
        is_ready: ReadyProbe,
        restarting: Callable[[], bool] = lambda: True,
    ) -> None:
        """Until cancelled or ``stopping``: report each child's exit at once, restart it later.

        ``on_exit(index, pid, how)`` runs on the event loop as soon as a child is seen to have
        exited; ``is_ready(index, pid)`` tells when a child serves (it resets the back-off once
        it did so for a while); while ``restarting()`` is False (the parent shuts down) a dead
        child stays dead.
        """
        schedules = [_Restarts() for _ in self.procs]
        while not self.stopping:
            await asyncio.sleep(POLL_S)
            now = time.monotonic()
            for index, schedule in enumerate(schedules):
                if self.stopping:
                    return
                self._watch_one(index, schedule, now, on_exit, is_ready, restarting())

    def _watch_one(
        self,
        index: int,
        schedule: _Restarts,
        now: float,
        on_exit: ExitCallback,
        is_ready: ReadyProbe,
        restarting: bool,
    ) -> None:
        proc = self.procs[index]
        if schedule.restart_at is not None:
            if restarting and now >= schedule.restart_at:
                schedule.restart_at = None
                self.procs[index] = self.spawn(index)
                self.restarts += 1
                logger.warning(
                    "restarted local %s %d (pid %d)", self.kind, index, self.procs[index].pid
                )
            return
        code = proc.poll()
        if code is None:
            if schedule.ready_since is None and is_ready(index, proc.pid):
                schedule.ready_since = now
            return
        how = describe_exit(code)
        on_exit(index, proc.pid, how)
        if schedule.ready_since is not None and now - schedule.ready_since >= STABLE_AFTER_S:
            schedule.backoff_s = FIRST_BACKOFF_S
        delay = schedule.backoff_s
        schedule.backoff_s = min(delay * 2, MAX_BACKOFF_S)
        schedule.ready_since = None
        schedule.restart_at = now + delay
        logger.warning(
            "local %s %d (pid %d) %s; starting it again in %.0f s",
            self.kind,
            index,
            proc.pid,
            how,
            delay,
        )

    def terminate(self, timeout_s: float) -> None:
        """SIGTERM every child, wait up to ``timeout_s`` for each, SIGKILL stragglers.

        No child is restarted from now on."""
        self.stopping = True
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
