"""The API's front door: every HTTP request passes here before FastAPI (plain ASGI).

- ``/v1``, ``/admin`` and the tokenizer routes answer 401 without a valid key (when keys are
  configured); the key's id goes to ``request.state.key_id`` (None without keys). Paths are
  read as routed: under ``--root-path`` too (``server_options.route_path``).
- ``POST /v1/completions`` and ``POST /v1/chat/completions`` go straight to their handlers.
  FastAPI wraps each request, and each chunk a streamed response sends, in five layers of its
  own (server errors, telemetry, body limit, exception handlers, an exit stack), and routes by
  trying the table in order: together a quarter of the coordinator's CPU per short request.
  The handlers read, validate and answer by themselves, so here they go without; what those
  layers gave them is kept: an unexpected exception is logged and answered with a 500 in
  OpenAI's error shape (or ends a stream already under way).
- Everything else (other methods and routes, ``/openapi.json``) is FastAPI's.
- While the server shuts down (``closing()``), every response says ``Connection: close``: a
  client on a kept-alive connection opens its next one to another coordinator, instead of
  finding this one closed under its next request.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from corefleet.engine.openai.admission import ApiKeys, unauthorized
from corefleet.engine.openai.errors import RequestError
from corefleet.engine.openai.replies import Reply, StreamReply, error_reply
from corefleet.engine.openai.server_options import route_path

logger = logging.getLogger(__name__)

Endpoint = Callable[[Request], Awaitable[Response]]

# What needs the key when keys are configured: vLLM guards /v1; the admin routes say how the
# fleet runs, and the tokenizer routes spend the server's CPU on whatever a client sends (vLLM
# leaves those open). Probes and load balancers' routes (/health, /ready, /metrics, /load,
# /version) stay open.
PROTECTED_PREFIXES = ("/v1", "/admin", "/tokenize", "/detokenize")


def reply_response(reply: Reply) -> Response:
    """A generation handler's :data:`Reply` as a Starlette response."""
    if isinstance(reply, StreamReply):
        return StreamingResponse(reply.events, media_type="text/event-stream")
    return Response(
        reply.body,
        status_code=reply.status,
        headers=dict(reply.headers),
        media_type="application/json",
    )


def error_response(err: RequestError) -> Response:
    """``err`` as an OpenAI error body with its status (and ``Retry-After`` on 429 and 503)."""
    return reply_response(error_reply(err))


class ApiFront:
    """The key check for every request, and the generation routes ahead of ``app``."""

    def __init__(
        self,
        app: ASGIApp,
        keys: ApiKeys,
        generation: Mapping[str, Endpoint],
        closing: Callable[[], bool] = lambda: False,
        root_path: str = "",
    ) -> None:
        self.app = app
        self.keys = keys
        self.generation = dict(generation)  # path -> handler of its POST
        self.closing = closing
        self.root_path = root_path  # --root-path: routed with or without it

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.closing():
            send = _closing_connection(send)
        key_id = None
        path = route_path(scope["path"], self.root_path)
        if self.keys and path.startswith(PROTECTED_PREFIXES):
            key_id = self.keys.identify(Headers(scope=scope).get("authorization"))
            if key_id is None:
                await error_response(unauthorized())(scope, receive, send)
                return
        scope.setdefault("state", {})["key_id"] = key_id
        endpoint = self.generation.get(path) if scope["method"] == "POST" else None
        if endpoint is None:
            await self.app(scope, receive, send)
            return
        try:
            response = await endpoint(Request(scope, receive))
        except Exception:
            logger.exception("POST %s failed", path)
            response = error_response(RequestError("internal server error", status=500))
        await response(scope, receive, send)


def _closing_connection(send: Send) -> Send:
    """``send`` that adds ``Connection: close`` to the response's headers."""

    async def closing_send(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = [h for h in message.get("headers", ()) if h[0].lower() != b"connection"]
            message = {**message, "headers": [*headers, (b"connection", b"close")]}
        await send(message)

    return closing_send
