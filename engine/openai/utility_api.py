"""The routes beside generation, as vLLM serves them: the model list, the tokenizer routes,
``/version`` and ``/load``.

- ``GET /v1/models`` and ``GET /v1/models/{model}``: vLLM's model card (``root``, ``parent``,
  ``max_model_len``, ``permission``). vLLM has no ``/v1/models/{model}``; OpenAI's API does,
  and the official client's ``models.retrieve`` calls it.
- ``POST /tokenize``, ``POST /detokenize`` (``tokenize_api``); ``GET /tokenizer_info`` only
  with ``--enable-tokenizer-info-endpoint`` (a 404 otherwise, as vLLM leaves it out).
- ``GET /version``: corefleet's version (vLLM answers its own the same way).
- ``GET /load``: the generation requests admitted and not yet answered, with
  ``--enable-server-load-tracking``; 0 without it, as vLLM.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib import metadata
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from corefleet.engine.openai import protocol as p
from corefleet.engine.openai.admission import read_body
from corefleet.engine.openai.errors import RequestError
from corefleet.engine.openai.front import error_response, reply_response
from corefleet.engine.openai.replies import Reply
from corefleet.engine.openai.server_state import ServerState
from corefleet.engine.openai.tokenize_api import TokenizeApi

try:
    VERSION = metadata.version("corefleet")
except metadata.PackageNotFoundError:  # pragma: no cover - not installed
    VERSION = "0"


def add_utility_routes(app: FastAPI, state: ServerState) -> None:
    """Add the model list, tokenizer, version and load routes to ``app``."""
    tokens = TokenizeApi(state)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return p.ModelList(data=[_card(state)]).model_dump()

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:
        try:
            state.check_model(model)
        except RequestError as err:
            return error_response(err)
        return JSONResponse(_card(state).model_dump())

    app.add_api_route("/tokenize", _posted(state, tokens.tokenize), methods=["POST"])
    app.add_api_route("/detokenize", _posted(state, tokens.detokenize), methods=["POST"])
    if state.server.enable_tokenizer_info_endpoint:

        @app.get("/tokenizer_info")
        async def tokenizer_info() -> dict[str, Any]:
            return tokens.tokenizer_info()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": VERSION}

    @app.get("/load")
    async def load() -> dict[str, int]:
        tracked = state.server.enable_server_load_tracking
        return {"server_load": state.limiter.requests if tracked else 0}


def _card(state: ServerState) -> p.ModelCard:
    ranks = state.fleet.membership.accepting()
    max_len = ranks[0].info.max_model_len if ranks and ranks[0].info else None
    return p.ModelCard(id=state.model_name, root=state.model_root or None, max_model_len=max_len)


def _posted(
    state: ServerState, endpoint: Callable[[bytes], Awaitable[Reply]]
) -> Callable[[Request], Awaitable[Response]]:
    """``endpoint`` as a route: the body read within the limits (413, 408), the reply sent."""
    limits = state.limits

    async def handler(request: Request) -> Response:
        try:
            raw = await read_body(request, limits.max_request_body_bytes, limits.body_timeout_s)
        except RequestError as err:
            return error_response(err)
        return reply_response(await endpoint(raw))

    return handler
