"""The soak benchmark's server side: start and stop ``corefleet serve``, sample its memory.

:func:`start_server` runs ``corefleet serve`` in its own session on a free loopback port, its
output in a log file, and returns once ``/ready`` answers 200; :func:`stop_server` sends SIGTERM
and kills the whole process group after a timeout. :class:`RssSampler` reads the RSS of the
server process and of every descendant (the engine-core ranks) with psutil.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

MIB = 1024 * 1024


def start_server(flags: list[str], timeout: float) -> tuple[subprocess.Popen[bytes], str, Path]:
    """Start ``corefleet serve`` on a free loopback port; return it once ``/ready`` is 200."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    argv = [sys.executable, *(["-P"] if sys.version_info >= (3, 11) else [])]
    argv += ["-m", "corefleet.engine.cli", "serve", *flags, "--host", "127.0.0.1"]
    argv += ["--port", str(port)]
    fd, name = tempfile.mkstemp(prefix="soak-serve-", suffix=".log")
    os.close(fd)
    log = Path(name)
    with log.open("wb") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=f, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    print(f"started: {' '.join(argv[1:])} (pid {proc.pid}, log {log})", flush=True)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"corefleet serve exited with {proc.returncode}:\n{tail}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/ready", timeout=2, trust_env=False).status_code == 200:
                    return proc, url, log
            time.sleep(0.5)
        raise TimeoutError(f"/ready not 200 after {timeout:.0f} s (log: {log})")
    except BaseException:  # Ctrl-C or a failed start: no server is left behind
        stop_server(proc, 10.0)
        raise


def stop_server(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    """SIGTERM, then SIGKILL to the whole group after ``timeout`` s (or on a second Ctrl-C);
    returns the exit status the server gave (negative: killed by that signal)."""
    code = proc.poll()
    if code is None:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=timeout)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            print(f"serve did not stop in {timeout:.0f} s: SIGKILL", file=sys.stderr)
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)  # what is left of the group: engine-core children
    proc.wait(timeout=10)
    return code if code is not None else proc.returncode


class RssSampler:
    """RSS of a server process and all its descendants, sampled on demand or periodically."""

    def __init__(self, pid: int) -> None:
        self.root = psutil.Process(pid)
        self.labels: dict[int, str] = {}
        self.samples: list[tuple[float, dict[int, int]]] = []  # (seconds into phase 2, RSS)

    def _label(self, p: psutil.Process) -> str:
        if p.pid == self.root.pid:
            return "coordinator"
        cmd = p.cmdline()
        if "engine-core" in cmd:
            rank = cmd[cmd.index("--rank") + 1] if "--rank" in cmd[:-1] else "?"
            return f"engine-core rank {rank}"
        return f"other ({p.name()})"

    def sample(self, t: float) -> None:
        rss: dict[int, int] = {}
        with contextlib.suppress(psutil.Error):
            for p in [self.root, *self.root.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    rss[p.pid] = p.memory_info().rss
                    self.labels.setdefault(p.pid, self._label(p))
        self.samples.append((t, rss))

    async def run(self, t0: float, interval: float) -> None:
        while True:
            self.sample(time.monotonic() - t0)
            await asyncio.sleep(interval)

    def series(self) -> list[dict[str, float]]:
        """Every sample: seconds into phase 2, then bytes per ``label (pid)``."""
        return [
            {"t": t, **{f"{self.labels.get(p, '?')} ({p})": float(v) for p, v in r.items()}}
            for t, r in self.samples
        ]

    def report(self, warm_t: float, limit_pct: float) -> list[dict[str, Any]]:
        """Per process: RSS at the first sample at or after ``warm_t`` and at the last sample."""
        warm_at, warm = next(((t, r) for t, r in self.samples if t >= warm_t), self.samples[-1])
        end_at, end = self.samples[-1]
        rows = []
        for pid in sorted(set(warm) | set(end)):
            label = self.labels.get(pid, "?")
            a, b = warm.get(pid), end.get(pid)
            growth = (b - a) / a * 100 if a and b else None
            checked = not label.startswith("other")
            ok = not checked or (growth is not None and growth < limit_pct)
            mib = [None if x is None else x / MIB for x in (a, b)]
            rows.append(
                dict(pid=pid, label=label, warm_mib=mib[0], end_mib=mib[1], growth_pct=growth,
                     checked=checked, ok=ok, warm_at_s=warm_at, end_at_s=end_at)
            )  # fmt: skip
        return rows
