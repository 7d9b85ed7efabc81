"""A rank started by a local parent exits when that parent dies, whatever the rank is doing.

``corefleet serve`` and the multiprocess clients start ranks as children. Once the parent is
gone, a rank serves nobody: its sockets lead nowhere and its KV cache is held for no one. The
busy loop cannot be relied on to notice (it may be loading the model, or blocked waiting for
INIT), so a thread of its own watches, from the first line of the process on.

It watches two things:

- the parent-death pipe (``--parent-fd``): the parent keeps the write end of a pipe open for the
  rank's whole life and passes it the read end. The kernel closes the write end when the parent
  dies, however it dies (SIGKILL, the OOM killer), so the read end reports EOF at once.
- ``os.getppid()`` (``--parent-pid``), every 0.25 s: a dead parent's children are reparented, so
  the parent pid changes. This is the fallback without a pipe, and a backstop for a write end
  that leaked into another process (a fork of the parent that did not exec keeps it open).

On the parent's death the watcher logs, asks the process to stop (aborting, never draining: the
client is gone), and exits hard if the process is still there after a short grace: nothing is
lost by exiting, and a rank stuck anywhere must not outlive its parent. A process that did stop
calls :meth:`ParentWatch.exit_if_parent_gone` once shut down, which skips the interpreter's
teardown: with torch loaded it takes a second or more, for nobody.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.25
EXIT_GRACE_S = 1.0
# Like SIGTERM while starting: the rank was told to go (by its parent's death), it did not fail.
PARENT_GONE_EXIT_CODE = 0


class ParentWatch(threading.Thread):
    """Waits for the parent's death, then stops the process (see the module docstring).

    ``on_parent_death`` runs on this thread. It returns True when it asked the process to stop
    by itself (which is then given ``grace_s`` before the hard exit), False to exit at once.
    """

    def __init__(
        self,
        rank: int,
        parent_pid: int | None,
        parent_fd: int | None,
        on_parent_death: Callable[[], bool],
        grace_s: float = EXIT_GRACE_S,
    ) -> None:
        # A daemon: a rank that exits normally must not wait for its watcher.
        super().__init__(name="corefleet-parent-watch", daemon=True)
        self.rank = rank
        self.parent_pid = parent_pid
        self.parent_fd = parent_fd
        self.on_parent_death = on_parent_death
        self.grace_s = grace_s
        self.parent_gone = threading.Event()

    def exit_if_parent_gone(self) -> None:
        """Exit at once if the parent died; for the end of the process's own clean-up."""
        if self.parent_gone.is_set():
            os._exit(PARENT_GONE_EXIT_CODE)

    def run(self) -> None:
        how = self._wait_for_death()
        self.parent_gone.set()
        logger.warning(
            "rank %d: parent process %s is gone (%s); aborting and exiting",
            self.rank,
            self.parent_pid if self.parent_pid is not None else "(pid unknown)",
            how,
        )
        if self.on_parent_death():
            time.sleep(self.grace_s)
            logger.warning(
                "rank %d: still running %.1f s after its parent died; exiting now",
                self.rank,
                self.grace_s,
            )
        # No clean-up and no atexit: whatever kept the process alive could block them too.
        os._exit(PARENT_GONE_EXIT_CODE)

    def _wait_for_death(self) -> str:
        """Block until the parent is gone; returns how that was seen, for the log."""
        fd = self.parent_fd
        poller: select.poll | None = None
        if fd is not None:
            poller = select.poll()  # not select(): it fails on descriptors above FD_SETSIZE
            poller.register(fd, select.POLLIN)
        while True:
            if poller is None or fd is None:
                time.sleep(POLL_INTERVAL_S)
            elif poller.poll(POLL_INTERVAL_S * 1000):
                try:
                    if not os.read(fd, 4096):  # EOF: no writer is left, so the parent is dead
                        return "its pipe was closed"
                except OSError as exc:  # e.g. a bad --parent-fd: the parent pid must do
                    logger.error("rank %d: cannot read parent pipe fd %d: %s", self.rank, fd, exc)
                    poller = None
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                return f"this process now has parent {os.getppid()}"


def watch_parent(
    rank: int,
    parent_pid: int | None,
    parent_fd: int | None,
    on_parent_death: Callable[[], bool],
) -> ParentWatch | None:
    """Start watching the parent; None (and nothing started) when no parent was named."""
    if parent_pid is None and parent_fd is None:
        return None
    watch = ParentWatch(rank, parent_pid, parent_fd, on_parent_death)
    watch.start()
    return watch
