"""``corefleet serve`` as a test fixture: start it, wait until it is ready, stop it cleanly."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_serve_ready(
    proc: subprocess.Popen[bytes], base: str, timeout: float, log: Path | None = None
) -> None:
    """Poll ``base``/ready until 200; fail (with ``log``'s text, if given) if ``proc`` exits or
    ``timeout`` seconds pass first."""
    tail = (lambda: "\n" + log.read_text()) if log is not None else (lambda: "")
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"corefleet serve exited with {proc.returncode}{tail()}"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                return
        assert time.monotonic() < deadline, f"corefleet serve not ready in {timeout} s{tail()}"
        time.sleep(0.2)


@contextlib.contextmanager
def running_serve(*flags: str, timeout: float = 120.0) -> Iterator[str]:
    """Yield the base URL of a ready ``corefleet serve``; on leaving, SIGTERM must exit 0."""
    with serve_process(*flags, timeout=timeout) as (_, base):
        yield base


@contextlib.contextmanager
def serve_process(
    *flags: str, timeout: float = 120.0
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """:func:`running_serve` that also yields the coordinator's process (its pid, its RSS)."""
    port = free_port()
    argv = [
        sys.executable,
        *(["-P"] if sys.version_info >= (3, 11) else []),
        *("-m", "corefleet.engine.cli", "serve", "--port", str(port), *flags),
    ]
    proc = subprocess.Popen(argv)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_serve_ready(proc, base, timeout)
        yield proc, base
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, "corefleet serve did not exit cleanly on SIGTERM"
    finally:
        proc.kill()
        proc.wait(timeout=10)
