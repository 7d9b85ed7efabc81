"""What a generation handler answers, whatever carries it to the client.

The generation POSTs are served by the coordinator's own HTTP protocol
(``engine/entrypoints/http_protocol.py``) and, when the app runs under another ASGI server,
through the front door (``front.py``). Both take a :data:`Reply`: a :class:`JsonReply` (status,
encoded body, extra headers) or a :class:`StreamReply` (server-sent events, sent as they come).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from corefleet.engine.openai.admission import RETRY_HEADERS
from corefleet.engine.openai.errors import RequestError

_JSON = msgspec.json.Encoder()


@dataclass(frozen=True)
class JsonReply:
    """A whole JSON answer: ``body`` is the encoded object."""

    status: int
    body: bytes
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class StreamReply:
    """A 200 whose body is ``events`` (``data: ...`` and a blank line each), sent one by one.
    Whoever sends it closes ``events`` when it stops early (the client went away)."""

    events: AsyncIterator[str]


Reply = JsonReply | StreamReply


def json_reply(payload: Any, status: int = 200) -> JsonReply:
    """``payload`` (plain JSON types: dicts, lists, strings, numbers) as a JSON answer."""
    return JsonReply(status, _JSON.encode(payload))


def error_reply(err: RequestError) -> JsonReply:
    """``err`` as an OpenAI error body with its status (and ``Retry-After`` on 429 and 503)."""
    headers = RETRY_HEADERS if err.status in (429, 503) else {}
    return JsonReply(err.status, _JSON.encode(err.to_response().model_dump()), headers)
