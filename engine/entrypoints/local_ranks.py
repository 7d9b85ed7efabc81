"""``corefleet serve``'s own ranks: ``corefleet engine-core`` children dialling the coordinator
over loopback, stopped with it.

The ranks must not outlive the coordinator, even one killed by SIGKILL or the OOM killer, which
runs no clean-up: each rank gets the read end of a pipe whose write end only this process holds
(``--parent-fd``). The kernel closes the write end when this process dies, and every rank sees
end of file at once, aborts and exits.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field

from corefleet.engine.config import EngineConfig
from corefleet.engine.engine_args import engine_argv_from_config

logger = logging.getLogger(__name__)


@dataclass
class LocalRanks:
    """``serve``'s own ranks: ``corefleet engine-core`` children on loopback."""

    config: EngineConfig
    count: int
    shutdown_mode: str
    shutdown_timeout_s: float
    procs: list[subprocess.Popen[bytes]] | None = None
    # The write end of the ranks' parent-death pipe (one pipe for all of them). Closed only in
    # stop(), after the ranks exited: closing it tells them their parent died, cutting a drain.
    parent_pipe: int | None = field(default=None, repr=False)

    def start(self, handshake_port: int) -> None:
        """Start the ranks; they dial ``127.0.0.1:handshake_port``."""
        self.procs = []
        read_end, self.parent_pipe = os.pipe()  # both ends close on exec unless passed
        try:
            for rank in range(self.count):
                argv = [
                    sys.executable,
                    *(["-P"] if sys.version_info >= (3, 11) else []),
                    *("-m", "corefleet.engine.cli", "engine-core"),
                    *("--coordinator", f"127.0.0.1:{handshake_port}", "--rank", str(rank)),
                    *("--parent-pid", str(os.getpid()), "--parent-fd", str(read_end)),
                    *("--health-port", "0"),
                    *("--shutdown-mode", self.shutdown_mode),
                    *("--shutdown-timeout", repr(self.shutdown_timeout_s)),
                    *engine_argv_from_config(self.config),
                ]
                self.procs.append(subprocess.Popen(argv, pass_fds=(read_end,)))
        finally:
            os.close(read_end)  # the ranks have their own copies; ours would only leak
        logger.info("started %d local engine rank(s)", self.count)

    def stop(self) -> None:
        """SIGTERM every rank (each drains or aborts as configured), wait, SIGKILL stragglers."""
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
            if self.parent_pipe is not None:
                os.close(self.parent_pipe)
                self.parent_pipe = None
