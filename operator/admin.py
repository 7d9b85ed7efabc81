"""What the coordinator says about its ranks (`GET /admin/engines`), when it can be reached.

Optional input to the status: it tells a rank that is still handshaking from one that is loading,
and a Ready rank that is draining. The coordinator may not exist yet, may be unreachable from the
operator's network, or may answer in a shape this module does not know; every such case yields
None quickly (short timeout) and the status falls back to what the pods say.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import aiohttp

STATES = {
    "hello": "handshaking",
    "handshaking": "handshaking",
    "init": "handshaking",
    "loading": "loading",
    "warming": "loading",
    "ready": "ready",
    "running": "ready",
    "active": "ready",
    "draining": "draining",
}


def parse_engines(payload: Any) -> dict[int, str] | None:
    """rank -> state from an `/admin/engines` document (a list, or {"engines": [...]}).

    Each entry needs a rank (`rank`, `engine_index` or `index`) and a state (`state` or
    `status`); a `draining: true` flag wins over the state. Unknown shapes give None.
    """
    items = payload.get("engines") if isinstance(payload, Mapping) else payload
    if not isinstance(items, list):
        return None
    joined: dict[int, str] = {}
    for item in items:
        if not isinstance(item, Mapping):
            continue
        rank = next((item[k] for k in ("rank", "engine_index", "index") if k in item), None)
        if not isinstance(rank, int) or isinstance(rank, bool):
            continue
        state = str(item.get("state") or item.get("status") or "").lower()
        joined[rank] = "draining" if item.get("draining") is True else STATES.get(state, state)
    return joined


async def fetch_engines(
    url: str, timeout: float, api_key: str | None = None
) -> dict[int, str] | None:
    """GET the coordinator's engine table; None if it is unreachable, slow, or unreadable.

    ``api_key``: the coordinator's ``--api-key`` (it guards /admin as it guards /v1).
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        client_timeout = aiohttp.ClientTimeout(total=timeout)
        async with (
            aiohttp.ClientSession(timeout=client_timeout) as session,
            session.get(url, headers=headers) as resp,
        ):
            if resp.status != 200:
                return None
            return parse_engines(await resp.json(content_type=None))
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, OSError):
        return None
