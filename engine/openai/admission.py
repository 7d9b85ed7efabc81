"""What a request must pass before the API spends anything on it: its key, its size, its turn.

- :class:`ApiKeys`: ``Authorization: Bearer KEY`` against the configured keys, compared in
  constant time (``hmac.compare_digest``), so response timing says nothing about a key.
- :func:`read_body`: the body, refused with 413 as soon as it is known to exceed the limit
  (``Content-Length``, or the bytes read so far), and with 408 when it trickles in too slowly.
- :class:`InFlightLimiter`: completions in flight, server-wide and per key; beyond either bound
  a request gets 429 with ``Retry-After``, as OpenAI's API answers a client over its rate.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from starlette.requests import ClientDisconnect, Request

from corefleet.engine.openai.errors import RequestError
from corefleet.engine.openai.limits import RETRY_AFTER_S

# Headers a refused-for-load response carries (429, and 503 while no rank is ready).
RETRY_HEADERS = {"Retry-After": str(RETRY_AFTER_S)}


class ApiKeys:
    """The accepted API keys; an empty set means the API is open."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._keys = [key.encode() for key in keys if key]

    def __bool__(self) -> bool:
        return bool(self._keys)

    def identify(self, authorization: str | None) -> str | None:
        """The caller's key id (a digest, never the key) for ``Authorization: Bearer KEY``,
        or None when the header names no accepted key. Every key is compared, in constant
        time, whatever matches first."""
        if not authorization or not authorization.startswith("Bearer "):
            return None
        given = authorization.removeprefix("Bearer ").encode()
        matched = None
        for key in self._keys:
            if hmac.compare_digest(given, key):
                matched = key
        return None if matched is None else hashlib.sha256(matched).hexdigest()[:16]


def unauthorized() -> RequestError:
    return RequestError("invalid or missing API key", status=401, type="invalid_api_key")


async def read_body(request: Request, max_bytes: int, timeout_s: float) -> bytes:
    """The request body, at most ``max_bytes`` of it, read within ``timeout_s``.

    Raises:
        RequestError: 413 when the body is larger than ``max_bytes`` (nothing more is read),
            408 when it is not complete within ``timeout_s``, 400 when the client went away.
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise body_too_large(max_bytes)
    try:
        async with asyncio.timeout(timeout_s):  # no task per request, as wait_for makes
            return await _read_limited(request, max_bytes)
    except asyncio.TimeoutError:
        raise RequestError(
            f"the request body did not arrive within {timeout_s:g} s (--body-timeout)",
            status=408,
            code="request_timeout",
        ) from None
    except ClientDisconnect:
        raise RequestError("the client disconnected while sending the body") from None


async def _read_limited(request: Request, max_bytes: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise body_too_large(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def body_too_large(max_bytes: int) -> RequestError:
    """The 413 of a body over ``max_bytes`` (``--max-request-body-bytes``)."""
    return RequestError(
        f"the request body is larger than {max_bytes} bytes (--max-request-body-bytes)",
        status=413,
        code="request_too_large",
    )


@dataclass
class Ticket:
    """Completions admitted for one request; :meth:`release` (idempotent) gives them back."""

    limiter: InFlightLimiter
    key: str | None
    weight: int
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.limiter._give_back(self)


class InFlightLimiter:
    """Counts completions in flight (a request weighs ``n`` × prompts), in total and per key.

    ``capacity`` gives the server-wide bound now (it follows the ranks that are ready); the
    per-key bound is fixed. A request heavier than a bound is still admitted when nothing else
    is in flight under it, so that a bound below ``--max-n`` slows big requests but never
    refuses them forever.
    """

    def __init__(self, capacity: Callable[[], int], per_key: int | None) -> None:
        self.capacity = capacity
        self.per_key = per_key
        self.in_flight = 0
        self.requests = 0  # admitted requests not yet answered (vLLM's server load, /load)
        self._per_key: dict[str, int] = {}
        self.refused = 0  # cumulative, for /metrics

    def admit(self, key: str | None, weight: int) -> Ticket:
        """A ticket for ``weight`` completions, or a 429 :class:`RequestError`."""
        if not _fits(self.in_flight, weight, self.capacity()):
            raise self._refuse("the server is at its limit of requests in flight")
        held = self._per_key.get(key, 0) if key is not None else 0
        if key is not None and self.per_key is not None and not _fits(held, weight, self.per_key):
            raise self._refuse("this API key is at its limit of requests in flight")
        self.in_flight += weight
        self.requests += 1
        if key is not None:
            self._per_key[key] = held + weight
        return Ticket(self, key, weight)

    def _refuse(self, why: str) -> RequestError:
        self.refused += 1
        return RequestError(
            f"{why}; retry after {RETRY_AFTER_S} s",
            status=429,
            type="requests",
            code="rate_limit_exceeded",
        )

    def _give_back(self, ticket: Ticket) -> None:
        self.in_flight -= ticket.weight
        self.requests -= 1
        if ticket.key is not None:
            left = self._per_key[ticket.key] - ticket.weight
            if left:
                self._per_key[ticket.key] = left
            else:
                del self._per_key[ticket.key]  # no entry per key ever seen: bounded memory


def _fits(held: int, weight: int, bound: int) -> bool:
    return held == 0 or held + weight <= bound
