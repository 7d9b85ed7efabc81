"""Processes of the local control plane: free ports, start with a log file, stop for sure.

A component dies with the process that started it (PR_SET_PDEATHSIG): a test run killed
outright (a CI timeout, a SIGKILL) leaves no API server or etcd behind.
"""

from __future__ import annotations

import ctypes
import pathlib
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # Runs in the child between fork and exec. SIGKILL: a component that outlived its test
    # has nothing to shut down gracefully for.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Component:
    """One binary of the control plane, run with its output in `<folder>/<name>.log`."""

    def __init__(self, name: str, argv: Sequence[str], folder: pathlib.Path) -> None:
        self.name, self.argv = name, list(argv)
        self.log = folder / f"{name}.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, env: Mapping[str, str] | None = None) -> None:
        """Start it (its own session, so a signal to the test's group does not reach it)."""
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=dict(env) if env is not None else None,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )

    def check_alive(self) -> None:
        """RuntimeError with the end of its log if it has exited."""
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.tail()}")

    def tail(self, chars: int = 4000) -> str:
        """The end of its log."""
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds; waits for it to be gone."""
        process = self.process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def poll(
    check: Callable[[], object],
    timeout: float,
    what: str,
    alive: Sequence[Component] = (),
    interval: float = 0.1,
) -> object:
    """Poll `check` until it returns something truthy; fail at once if a component died."""
    deadline = time.monotonic() + timeout
    while True:
        for component in alive:
            component.check_alive()
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
