"""Watch events of the Kubernetes emulator: a bounded replay history and the live subscribers.

A watch that starts from a resourceVersion gets every later event of its resource from the
history; one older than the history holds is told `410 Expired` (HTTP 200, then an ERROR event
whose object is the `v1 Status`, as the real server does), and clients such as kopf and kubectl
then list again. A watch with `allowWatchBookmarks=true` gets a BOOKMARK event (the kind, and
only `metadata.resourceVersion`, the store's latest) whenever it had no event for
`KubeEmu.bookmark_seconds` (the real server sends one about every minute).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp.web
from kubeemu_request import StatusError

Event = dict[str, Any]
CLOSED: Event = {"type": "CLOSED"}  # not a Kubernetes event: ends the stream


class EventLog:
    """Every ADDED/MODIFIED/DELETED event, per resource path ("v1/pods"), for watches."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._history: list[tuple[int, str, Event]] = []
        self._floor = 0  # events at or below this resourceVersion were dropped
        self._watchers: dict[str, set[asyncio.Queue[Event]]] = {}

    def emit(self, path: str, kind: str, obj: dict[str, Any]) -> None:
        """Record an event (with a copy of the object) and hand it to current watchers."""
        event = {"type": kind, "object": json.loads(json.dumps(obj))}
        self._history.append((int(obj["metadata"]["resourceVersion"]), path, event))
        if len(self._history) > self.size:
            self._floor = self._history[-self.size - 1][0]
            del self._history[: -self.size]
        for queue in self._watchers.get(path, ()):
            queue.put_nowait(event)

    def since(self, path: str, resource_version: int) -> list[Event]:
        """The events of a resource after a resourceVersion; 410 when they were dropped."""
        if resource_version < self._floor:
            raise StatusError(
                410, "Expired", f"too old resource version: {resource_version} ({self._floor})"
            )
        return [event for rv, p, event in self._history if p == path and rv > resource_version]

    def subscribe(self, path: str) -> asyncio.Queue[Event]:
        """A queue that receives the resource's future events."""
        queue: asyncio.Queue[Event] = asyncio.Queue()
        self._watchers.setdefault(path, set()).add(queue)
        return queue

    def unsubscribe(self, path: str, queue: asyncio.Queue[Event]) -> None:
        """Stop delivering to a queue."""
        self._watchers.get(path, set()).discard(queue)

    def close(self) -> None:
        """End every open watch (the server is stopping: its handlers must return)."""
        for queues in self._watchers.values():
            for queue in queues:
                queue.put_nowait(CLOSED)


async def stream(
    raw_request: aiohttp.web.BaseRequest,
    replay: Sequence[Event],
    queue: asyncio.Queue[Event],
    shown: Callable[[Event], Event | None],
    timeout: float,
    expired: StatusError | None = None,
    bookmark: Callable[[], Event] | None = None,
    bookmark_every: float = 1.0,
) -> aiohttp.web.StreamResponse:
    """Answer a watch: the replayed events, then the queue's, as JSON lines, for `timeout`
    seconds or until the client leaves; `shown` filters/renders each event (None: skipped).
    With `expired`, the only event is that ERROR, and the stream ends. With `bookmark`, a
    BOOKMARK event it makes goes out whenever nothing else did for `bookmark_every` seconds."""
    response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
    await response.prepare(raw_request)
    pending: asyncio.Queue[Event] = asyncio.Queue()
    for event in replay:
        pending.put_nowait(event)
    try:
        if expired is not None:
            error = {"type": "ERROR", "object": expired.status()}
            await response.write(json.dumps(error).encode() + b"\n")
            return response
        async with asyncio.timeout(timeout):
            while True:
                if not pending.empty():
                    raw = pending.get_nowait()
                elif bookmark is None:
                    raw = await queue.get()
                else:
                    try:
                        raw = await asyncio.wait_for(queue.get(), bookmark_every)
                    except TimeoutError:
                        if queue.empty():  # its resourceVersion covers every event sent
                            mark = json.dumps(bookmark())
                            await response.write(mark.encode() + b"\n")
                        continue
                if raw is CLOSED:
                    break
                shown_event = shown(raw)
                if shown_event is not None:
                    await response.write(json.dumps(shown_event).encode() + b"\n")
    except (TimeoutError, ConnectionError):
        pass
    with contextlib.suppress(ConnectionError):
        await response.write_eof()
    return response
