"""Waiting queues for the scheduler: first-come-first-served, or by priority."""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator

from corefleet.engine.request import Request


class RequestQueue(ABC):
    """The scheduler's waiting requests, head first."""

    @abstractmethod
    def add(self, request: Request) -> None:
        """Enqueue a new request."""

    @abstractmethod
    def prepend(self, request: Request) -> None:
        """Re-enqueue a preempted request so it is served before newer arrivals."""

    @abstractmethod
    def peek(self) -> Request:
        """The request that would be popped next (IndexError when empty)."""

    @abstractmethod
    def pop(self) -> Request:
        """Remove and return the head (IndexError when empty)."""

    @abstractmethod
    def remove_requests(self, request_ids: set[str]) -> None:
        """Drop the requests with these ids (O(n); aborts are rare)."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """Iterate in no guaranteed order (in head-first order for FCFS)."""

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSRequestQueue(RequestQueue):
    """Arrival order; a preempted request goes back to the head."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove_requests(self, request_ids: set[str]) -> None:
        kept = [r for r in self._queue if r.request_id not in request_ids]
        self._queue = deque(kept)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue(RequestQueue):
    """A heap ordered by ``Request.__lt__``: lower priority value, then earlier arrival.

    A preempted request keeps its priority and arrival time, so pushing it back is enough to
    put it ahead of everything that arrived after it.
    """

    def __init__(self) -> None:
        self._heap: list[Request] = []

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, request)

    def prepend(self, request: Request) -> None:
        heapq.heappush(self._heap, request)

    def peek(self) -> Request:
        return self._heap[0]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)

    def remove_requests(self, request_ids: set[str]) -> None:
        self._heap = [r for r in self._heap if r.request_id not in request_ids]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._heap)


def create_request_queue(policy: str) -> RequestQueue:
    """The waiting queue for a scheduling policy (``"fcfs"`` or ``"priority"``)."""
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ValueError(f"unknown scheduling policy {policy!r}: expected fcfs or priority")


def preemption_victim(running: list[Request], policy: str) -> int:
    """Index in ``running`` (admission order) of the request to preempt next."""
    if policy == "priority":
        # Lowest priority (largest value) first, then the latest arrival.
        return max(
            range(len(running)), key=lambda i: (running[i].priority, running[i].arrival_time)
        )
    return len(running) - 1  # FCFS: the most recently admitted
