"""Processes of the local control plane: free ports, start with a log file, stop for sure.

A component dies with the process that started it (PR_SET_PDEATHSIG): a test run killed
outright (a CI timeout, a SIGKILL) leaves no API server or etcd behind.
"""

from __future__ import annotations

import ctypes
import os
import pathlib
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence

PR_SET_PDEATHSIG = 1
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
# Ports are drawn from the PORT_SPAN ports below the ephemeral range, never below PORT_FLOOR
# (the registered ports well-known services listen on).
PORT_SPAN = 12000
PORT_FLOOR = 10000
_handed_out: set[int] = set()


def _die_with_parent() -> None:
    # Runs in the child between fork and exec. SIGKILL: a component that outlived its test
    # has nothing to shut down gracefully for.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = pathlib.Path(EPHEMERAL_RANGE_FILE).read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _port_slice() -> tuple[int, int]:
    """[floor, ceiling): the ports this process draws from. Under pytest-xdist each worker
    has a slice of its own, so two workers never draw the same port."""
    low, _ = _ephemeral_range()
    floor = max(PORT_FLOOR, low - PORT_SPAN)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw0", "gw1", ...
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if not worker.startswith("gw") or workers <= 1:
        return floor, low
    size = (low - floor) // workers
    start = floor + int(worker[2:]) % workers * size
    return start, start + size


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, outside the ephemeral range.

    Not `bind(0)`: that hands out a port of the ephemeral range, which the kernel also gives
    to outgoing connections as their source port. Between our probe and the component's own
    bind, one of the hundreds of connections the API server opens to etcd (or a client to the
    API server) could take it: seen in CI as "bind: address already in use" for etcd and for
    kube-apiserver. A port below the range is never a source port, so only another listener
    could take it, and the probe rules out the ones listening now.

    A port is handed out once per process: two calls before either port is bound (etcd's
    client and peer ports) must not get the same one, as two `bind(0)` probes can.
    """
    floor, low = _port_slice()
    if len(_handed_out) > (low - floor) // 2:
        _handed_out.clear()  # a long run: the earliest ones are long closed
    for _ in range(200):
        port = random.randrange(floor, low)
        if port in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in {floor}-{low - 1} after 200 tries")


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
