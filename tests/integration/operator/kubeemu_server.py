"""Serving `KubeEmu` on loopback: in the current loop, or from a thread of its own."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from typing import Any

import kmock
from kubeemu import KubeEmu


@contextlib.asynccontextmanager
async def serve(emu: KubeEmu) -> AsyncIterator[str]:
    """Serve the emulator on a free 127.0.0.1 port; yields the base URL.

    On the way out, open watches are ended first: aiohttp would otherwise wait for their
    handlers, which idle until their timeoutSeconds.
    """
    async with emu, kmock.Server(emu) as server:
        try:
            yield str(server.url).rstrip("/")
        finally:
            emu.close_watches()
            await asyncio.sleep(0)  # let the handlers see it and return


class ServedInThread:
    """Serve the emulator from its own thread and event loop, like a real API server.

    kopf, on exit, waits 5 s for and then cancels every task created after it started in its
    loop; an emulator in the same loop would be among them. In its own thread it is not, and the
    operator talks to it only over the socket. Reading `emu.objects` from the test thread is safe
    enough: the emulator replaces whole objects and never iterates while it mutates.
    """

    def __init__(self, emu: KubeEmu, start_timeout: float = 10.0) -> None:
        self.emu, self.url = emu, ""
        self._ready, self._timeout = threading.Event(), start_timeout
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._main()), name="kube-emulator", daemon=True
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        async with serve(self.emu) as url:
            self.url = url
            self._ready.set()
            await self._stop.wait()

    def __enter__(self) -> str:
        self._thread.start()
        if not self._ready.wait(self._timeout):
            raise TimeoutError("the emulator did not start")
        return self.url

    def __exit__(self, *exc: Any) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(self._timeout)
