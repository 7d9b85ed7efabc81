"""The coordinator's event loop: uvloop's where it is installed (a dependency on Linux).

With the generation POSTs served without ASGI (``http_protocol.py``), the event loop's own
work (selecting, callbacks, transports) is a large share of a short request's CPU, and
uvloop's loop takes 13 % less CPU a request and streams 11 % more tokens a second than
asyncio's (``benchmarks/README.md``, ``coordinator.py``). Without uvloop (another platform,
or a ``--no-deps`` install) asyncio's loop serves the same way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)``, on uvloop's event loop when it is installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
