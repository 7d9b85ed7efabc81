"""``corefleet serve``'s own ranks: ``corefleet engine-core`` children dialling the coordinator
over loopback, watched, restarted when they die, stopped with it.

The ranks must not outlive the coordinator, even one killed by SIGKILL or the OOM killer, which
runs no clean-up: each rank gets the read end of a pipe whose write end only this process holds
(``--parent-fd``). The kernel closes the write end when this process dies, and every rank sees
end of file at once, aborts and exits.

:meth:`LocalRanks.supervise` watches the children: a child that exits is reported at once
(with its exit code or signal), also one that dies while loading, and is started again after a
back-off of 1 s, doubling up to 30 s, back to 1 s once a child served for a while. What "dead"
means for the fleet is the caller's business (a callback), as is "ready".
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from corefleet.engine.config import EngineConfig
from corefleet.engine.engine_args import engine_argv_from_config
from corefleet.engine.entrypoints.rank_cpus import RankCpus
from corefleet.engine.transport.handshake import describe_exit

logger = logging.getLogger(__name__)

# (rank, pid, how it ended: "was killed by SIGKILL (exit code -9)")
ExitCallback = Callable[[int, int, str], None]
# (rank, pid) -> whether that process serves now
ReadyProbe = Callable[[int, int], bool]

POLL_S = 0.1  # how late a child's exit is noticed at worst
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
STABLE_AFTER_S = 60.0  # ready this long: the next death is a fresh failure, not a crash loop


@dataclass
class _Restarts:
    """One rank's restart schedule."""

    backoff_s: float = FIRST_BACKOFF_S
    ready_since: float | None = None
    restart_at: float | None = None  # set while the rank waits to be started again


@dataclass
class LocalRanks:
    """``serve``'s own ranks: ``corefleet engine-core`` children on loopback."""

    config: EngineConfig
    count: int
    shutdown_mode: str
    shutdown_timeout_s: float
    # Each rank's cores (``rank_cpus.py``); a rank without an entry keeps the full affinity.
    rank_cpus: list[RankCpus] = field(default_factory=list)
    procs: list[subprocess.Popen[bytes]] | None = None
    restarts: int = 0  # children started again after they died
    # The write end of the ranks' parent-death pipe (one pipe for all of them). Closed only in
    # stop(), after the ranks exited: closing it tells them their parent died, cutting a drain.
    parent_pipe: int | None = field(default=None, repr=False)
    _pipe_read_end: int | None = field(default=None, repr=False)  # kept for restarts
    _handshake_port: int = field(default=0, repr=False)
    _stopping: bool = field(default=False, repr=False)

    def start(self, handshake_port: int) -> None:
        """Start the ranks; they dial ``127.0.0.1:handshake_port``."""
        self._handshake_port = handshake_port
        self._pipe_read_end, self.parent_pipe = os.pipe()  # both close on exec unless passed
        self.procs = [self._spawn(rank) for rank in range(self.count)]
        logger.info("started %d local engine rank(s)", self.count)

    def _spawn(self, rank: int) -> subprocess.Popen[bytes]:
        assert self._pipe_read_end is not None
        cpus = self.rank_cpus[rank] if rank < len(self.rank_cpus) else None
        argv = [
            sys.executable,
            *(["-P"] if sys.version_info >= (3, 11) else []),
            *("-m", "corefleet.engine.cli", "engine-core"),
            *("--coordinator", f"127.0.0.1:{self._handshake_port}", "--rank", str(rank)),
            *("--parent-pid", str(os.getpid()), "--parent-fd", str(self._pipe_read_end)),
            *("--health-port", "0"),
            *("--shutdown-mode", self.shutdown_mode),
            *("--shutdown-timeout", repr(self.shutdown_timeout_s)),
            *(cpus.argv() if cpus is not None else []),
            *engine_argv_from_config(self.config),
        ]
        env = cpus.env(dict(os.environ)) if cpus is not None else None
        return subprocess.Popen(argv, pass_fds=(self._pipe_read_end,), env=env)

    async def supervise(
        self,
        on_exit: ExitCallback,
        is_ready: ReadyProbe,
        restarting: Callable[[], bool] = lambda: True,
    ) -> None:
        """Until cancelled or :meth:`stop`: report each child's exit at once, restart it later.

        ``on_exit(rank, pid, how)`` runs on the event loop as soon as a child is seen to have
        exited; ``is_ready(rank, pid)`` tells when a child serves (it resets the back-off once
        it did so for a while); while ``restarting()`` is False (the coordinator shuts down)
        a dead child stays dead.
        """
        schedules = [_Restarts() for _ in range(self.count)]
        while not self._stopping:
            await asyncio.sleep(POLL_S)
            now = time.monotonic()
            for rank, schedule in enumerate(schedules):
                if self._stopping:
                    return
                self._watch_one(rank, schedule, now, on_exit, is_ready, restarting())

    def _watch_one(
        self,
        rank: int,
        schedule: _Restarts,
        now: float,
        on_exit: ExitCallback,
        is_ready: ReadyProbe,
        restarting: bool,
    ) -> None:
        assert self.procs is not None
        proc = self.procs[rank]
        if schedule.restart_at is not None:
            if restarting and now >= schedule.restart_at:
                schedule.restart_at = None
                self.procs[rank] = self._spawn(rank)
                self.restarts += 1
                logger.warning(
                    "restarted local engine rank %d (pid %d)", rank, self.procs[rank].pid
                )
            return
        code = proc.poll()
        if code is None:
            if schedule.ready_since is None and is_ready(rank, proc.pid):
                schedule.ready_since = now
            return
        how = describe_exit(code)
        on_exit(rank, proc.pid, how)
        if schedule.ready_since is not None and now - schedule.ready_since >= STABLE_AFTER_S:
            schedule.backoff_s = FIRST_BACKOFF_S
        delay = schedule.backoff_s
        schedule.backoff_s = min(delay * 2, MAX_BACKOFF_S)
        schedule.ready_since = None
        schedule.restart_at = now + delay
        logger.warning(
            "local engine rank %d (pid %d) %s; starting it again in %.0f s",
            rank,
            proc.pid,
            how,
            delay,
        )

    def stop(self) -> None:
        """SIGTERM every rank (each drains or aborts as configured), wait, SIGKILL stragglers.

        No rank is restarted from now on."""
        self._stopping = True
        try:
            for proc in self.procs or []:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in self.procs or []:
                try:
                    proc.wait(timeout=self.shutdown_timeout_s + 5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        finally:
            if self._pipe_read_end is not None:
                os.close(self._pipe_read_end)
                self._pipe_read_end = None
            if self.parent_pipe is not None:
                os.close(self.parent_pipe)
                self.parent_pipe = None
