"""``corefleet serve``'s own ranks: ``corefleet engine-core`` children dialling the coordinator
over loopback, stopped with it."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass

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

    def start(self, handshake_port: int) -> None:
        self.procs = []
        for rank in range(self.count):
            argv = [
                sys.executable,
                *(["-P"] if sys.version_info >= (3, 11) else []),
                *("-m", "corefleet.engine.cli", "engine-core"),
                *("--coordinator", f"127.0.0.1:{handshake_port}", "--rank", str(rank)),
                *("--parent-pid", str(os.getpid()), "--health-port", "0"),
                *("--shutdown-mode", self.shutdown_mode),
                *("--shutdown-timeout", repr(self.shutdown_timeout_s)),
                *engine_argv_from_config(self.config),
            ]
            self.procs.append(subprocess.Popen(argv))
        logger.info("started %d local engine rank(s)", self.count)

    def stop(self) -> None:
        for proc in self.procs or []:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs or []:
            try:
                proc.wait(timeout=self.shutdown_timeout_s + 5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
