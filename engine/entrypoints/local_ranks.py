"""``corefleet serve``'s own ranks: ``corefleet engine-core`` children dialling the local
coordinators over loopback, watched, restarted when they die, stopped with their parent.

The ranks must not outlive their parent, even one killed by SIGKILL or the OOM killer, which
runs no clean-up: each rank gets the read end of a pipe whose write end only this process holds
(``--parent-fd``). The kernel closes the write end when this process dies, and every rank sees
end of file at once, aborts and exits.

:meth:`LocalRanks.supervise` watches the children (``respawn.py``): a child that exits is
reported at once and started again after a back-off.

The ranks share this process's memory: :func:`rank_memory_share` reads what it may use before
any rank starts and gives each rank its part (``COREFLEET_RANK_MEMORY``), from which the rank
sizes its KV cache after its weights (``worker/kv_budget.py``); ranks that each read the
machine's free memory for themselves would each take all of it.

With several ranks, each also gets ``--data-parallel-size`` and a ``--data-parallel-address``
on loopback (a port free at start, kept across restarts): ranks of an MoE model form their
group there (``engine_core/dp_proc.py``), others ignore it. When a rank of the group dies its
peers exit too, and each is restarted here; the group forms again from the new processes.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from corefleet.engine import envs
from corefleet.engine.config import EngineConfig
from corefleet.engine.engine_args import engine_argv_from_config
from corefleet.engine.entrypoints.rank_cpus import RankCpus
from corefleet.engine.entrypoints.respawn import ExitCallback, ReadyProbe, Respawner
from corefleet.engine.worker.kv_budget import WorkerMemory, check_explicit_budget
from corefleet.engine.worker.memory_allowance import read_memory_allowance

logger = logging.getLogger(__name__)


@dataclass
class LocalRanks:
    """``serve``'s own ranks: ``corefleet engine-core`` children on loopback."""

    config: EngineConfig
    count: int
    shutdown_mode: str
    shutdown_timeout_s: float
    # Each rank's cores (``rank_cpus.py``); a rank without an entry keeps the full affinity.
    rank_cpus: list[RankCpus] = field(default_factory=list)
    # Each rank's bytes of memory (``rank_memory_share``); None: each rank reads its own.
    memory_share: int | None = None
    procs: list[subprocess.Popen[bytes]] | None = None
    # The write end of the ranks' parent-death pipe (one pipe for all of them). Closed only in
    # stop(), after the ranks exited: closing it tells them their parent died, cutting a drain.
    parent_pipe: int | None = field(default=None, repr=False)
    _pipe_read_end: int | None = field(default=None, repr=False)  # kept for restarts
    _coordinator: str = field(default="", repr=False)
    _dp_address: str = field(default="", repr=False)  # rank 0's rendezvous (several ranks)
    _respawner: Respawner | None = field(default=None, repr=False)

    def start(self, coordinator: int | str) -> None:
        """Start the ranks; they dial ``127.0.0.1:coordinator`` (a handshake port), or
        ``--coordinator coordinator`` (several local coordinators, comma-separated)."""
        self._coordinator = (
            coordinator if isinstance(coordinator, str) else f"127.0.0.1:{coordinator}"
        )
        self._pipe_read_end, self.parent_pipe = os.pipe()  # both close on exec unless passed
        if self.count > 1:
            self._dp_address = f"127.0.0.1:{_free_port()}"
        self.procs = [self._spawn(rank) for rank in range(self.count)]
        self._respawner = Respawner("engine rank", self.procs, self._spawn)
        logger.info("started %d local engine rank(s)", self.count)

    @property
    def restarts(self) -> int:
        """Children started again after they died."""
        return self._respawner.restarts if self._respawner is not None else 0

    def _spawn(self, rank: int) -> subprocess.Popen[bytes]:
        assert self._pipe_read_end is not None
        cpus = self.rank_cpus[rank] if rank < len(self.rank_cpus) else None
        argv = [
            sys.executable,
            *(["-P"] if sys.version_info >= (3, 11) else []),
            *("-m", "corefleet.engine.cli", "engine-core"),
            *("--coordinator", self._coordinator, "--rank", str(rank)),
            *("--parent-pid", str(os.getpid()), "--parent-fd", str(self._pipe_read_end)),
            *("--health-port", "0"),
            *("--shutdown-mode", self.shutdown_mode),
            *("--shutdown-timeout", repr(self.shutdown_timeout_s)),
            *self._data_parallel_argv(),
            *(cpus.argv() if cpus is not None else []),
            *engine_argv_from_config(self.config),
        ]
        env = dict(os.environ)
        if cpus is not None:
            env = cpus.env(env) or env
        if self.memory_share is not None:
            env[envs.RANK_MEMORY] = str(self.memory_share)
        return subprocess.Popen(argv, pass_fds=(self._pipe_read_end,), env=env)

    def _data_parallel_argv(self) -> list[str]:
        if not self._dp_address:
            return []
        size, address = str(self.count), self._dp_address
        return ["--data-parallel-size", size, "--data-parallel-address", address]

    async def supervise(
        self,
        on_exit: ExitCallback,
        is_ready: ReadyProbe,
        restarting: Callable[[], bool] = lambda: True,
    ) -> None:
        """Report each rank's exit at once (``on_exit(rank, pid, how)``), restart it later
        (``Respawner.supervise``), until cancelled or :meth:`stop`."""
        assert self._respawner is not None, "start() first"
        await self._respawner.supervise(on_exit, is_ready, restarting)

    def stop(self) -> None:
        """SIGTERM every rank (each drains or aborts as configured), wait, SIGKILL stragglers.

        No rank is restarted from now on."""
        try:
            if self._respawner is not None:
                self._respawner.terminate(self.shutdown_timeout_s + 5)
        finally:
            if self._pipe_read_end is not None:
                os.close(self._pipe_read_end)
                self._pipe_read_end = None
            if self.parent_pipe is not None:
                os.close(self.parent_pipe)
                self.parent_pipe = None


def rank_memory_share(config: EngineConfig, count: int) -> int | None:
    """Each of ``count`` local ranks' part of the memory this process may use now (None when
    unknown); an explicit ``--kv-cache-memory`` that cannot fit it is refused here
    (``KVBudgetError``, a ValueError), before any rank starts."""
    allowance = read_memory_allowance()
    free = allowance.free
    if free is None:
        return None
    share = free // count
    source = allowance.sources() + (f", split among {count} ranks" if count > 1 else "")
    check_explicit_budget(config, WorkerMemory(share, 1, source))
    logger.info("memory: %.2f GiB for each of %d rank(s) (%s)", share / (1 << 30), count, source)
    return share


def _free_port() -> int:
    """A loopback port free now (rank 0 binds it a few seconds later: a small race, as for
    every local rendezvous port)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
