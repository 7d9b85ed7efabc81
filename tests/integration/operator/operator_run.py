"""The operator under test: in the test's event loop, or as `corefleet-operator` processes.

`running_operator()` runs `kopf.operator()` with corefleet's handlers in the current loop (it logs
in through KUBECONFIG, as `kopf run` would); enter it inside the test body (kopf cancels tasks
newer than itself on exit, which would include an async fixture's teardown). It yields a
`RunningOperator`: the task, and `log`, kopf's per-object log records, which say what the operator
has processed (`Timer 'engine_timer' succeeded.` after each timer reconcile of an engine,
`Handler 'rank_pod_event' succeeded.` after each pod event). A test that asserts that nothing
(more) happened first waits for such records: the operator has seen the state and acted on it,
more than once, and still did nothing; no fixed sleep stands in for that.

`operator_process()` starts the real console script with a kubeconfig of its own; its output
goes to a file, which `ProcessLog` reads the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Sequence
from typing import Any

import kopf
from operator_harness import eventually

TIMER = "Timer 'engine_timer' succeeded."
POD_EVENT = "Handler 'rank_pod_event' succeeded."
DELETED = "Handler 'engine_deleted' succeeded."


class OperatorLog(logging.Handler):
    """kopf's per-object log records of an in-process operator: (object name, message)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        ref = getattr(record, "k8s_ref", None) or {}
        with self._lock:
            self.records.append((str(ref.get("name", "")), record.getMessage()))

    def count(self, name: str, message: str) -> int:
        """How many records about object `name` carry `message`."""
        with self._lock:
            return sum(1 for n, m in self.records if n == name and message in m)

    async def more(self, name: str, message: str, n: int = 1, timeout: float = 60.0) -> None:
        """Wait for `n` more records about `name` carrying `message` than there are now."""
        start = self.count(name, message)
        await eventually(
            lambda: self.count(name, message) >= start + n,
            timeout,
            f"{n} more {message!r} about {name}",
        )

    async def ticks(self, n: int = 2, name: str = "llama", timeout: float = 60.0) -> None:
        """Wait until the timer has reconciled engine `name` `n` more times (each after the
        state the test set up: the timer reads kopf's latest view of the engine and indexes)."""
        await self.more(name, TIMER, n, timeout)


class RunningOperator:
    """An in-process operator: its task and its log."""

    def __init__(self, task: asyncio.Task[None], log: OperatorLog) -> None:
        self.task, self.log = task, log


@contextlib.asynccontextmanager
async def running_operator(**options: Any) -> AsyncIterator[RunningOperator]:
    """Run corefleet's kopf operator until the block ends; it must stop within 15 s."""
    import corefleet.operator.main  # noqa: F401  (registers the handlers)

    stop, ready = asyncio.Event(), asyncio.Event()
    settings = kopf.OperatorSettings()
    # kopf waits for idle per-object workers on exit; they idle out after this (default 5 s).
    settings.queueing.idle_timeout = 0.3
    settings.posting.idle_timeout = 0.3
    options.setdefault("settings", settings)
    options.setdefault("namespaces", ["default"])
    options.setdefault("standalone", True)
    log = OperatorLog()
    objects = logging.getLogger("kopf.objects")
    level = objects.level
    objects.setLevel(logging.INFO)
    objects.addHandler(log)
    task = asyncio.create_task(kopf.operator(stop_flag=stop, ready_flag=ready, **options))
    try:
        await asyncio.wait_for(ready.wait(), 30)
        yield RunningOperator(task, log)
    finally:
        stop.set()
        try:
            await asyncio.wait_for(task, 30)
        finally:
            objects.removeHandler(log)
            objects.setLevel(level)


class ProcessLog:
    """The log of an operator process: kopf's lines, `[namespace/name] message`."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path

    def text(self) -> str:
        """Everything the process wrote so far."""
        return self.path.read_text(errors="replace") if self.path.exists() else ""

    def count(self, name: str, message: str) -> int:
        """How many lines about object `name` (any, with "") carry `message`."""
        prefix = re.compile(rf"\[(?:[\w.-]+/)?{re.escape(name)}\] ") if name else None
        return sum(
            1
            for line in self.text().splitlines()
            if message in line and (prefix is None or prefix.search(line))
        )

    async def more(self, name: str, message: str, n: int = 1, timeout: float = 60.0) -> None:
        """Wait for `n` more lines about `name` carrying `message` than there are now."""
        start = self.count(name, message)
        await eventually(
            lambda: self.count(name, message) >= start + n,
            timeout,
            f"{n} more {message!r} about {name} in {self.path.name}",
        )

    async def ticks(self, n: int = 2, name: str = "llama", timeout: float = 60.0) -> None:
        """As `OperatorLog.ticks`."""
        await self.more(name, TIMER, n, timeout)


def operator_command(*args: str) -> list[str]:
    """The real `corefleet-operator` command line (no liveness endpoint unless given)."""
    base = [sys.executable, "-c", "from corefleet.operator.cli import cli; cli()"]
    return [*base, *args] if "--liveness" in args else [*base, "--liveness", "", *args]


@contextlib.asynccontextmanager
async def operator_process(
    kubeconfig: pathlib.Path, log_path: pathlib.Path, *args: str, stop: str = "kill"
) -> AsyncIterator[tuple[subprocess.Popen[bytes], ProcessLog]]:
    """A `corefleet-operator` process logging to `log_path`. On the way out it is SIGKILLed
    (`stop="kill"`) or SIGTERMed and must exit 0 within 30 s (`stop="term"`) if it still runs."""
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    with log_path.open("wb") as out:
        proc = subprocess.Popen(
            operator_command(*args), env=env, stdout=out, stderr=subprocess.STDOUT
        )
        try:
            yield proc, ProcessLog(log_path)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL if stop == "kill" else signal.SIGTERM)
            code = await asyncio.to_thread(proc.wait, 30)
            if stop == "term":
                assert code == 0, ProcessLog(log_path).text()[-4000:]


def lines_with(log: ProcessLog, text: str) -> Sequence[str]:
    """The lines of a process log that contain `text`."""
    return [line for line in log.text().splitlines() if text in line]
