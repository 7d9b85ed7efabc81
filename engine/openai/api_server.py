"""The coordinator's HTTP API: OpenAI's completions, chat and models, plus health and metrics.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models`` (and
vLLM's tokenizer, version and load routes: ``utility_api.py``), ``GET /health`` (the process
works), ``GET /ready`` (503, retryable, while no rank serves or while shutting down),
``GET /metrics`` (Prometheus), ``GET /admin/engines`` (JSON per rank), ``GET /openapi.json``
(``openapi.py``). With API keys, ``/v1/*``, ``/admin/*`` and the tokenizer routes answer 401
without ``Authorization: Bearer KEY`` (``front.py``). Under ``--root-path`` every route is
also served with that prefix, and the document names it in ``servers``. Bad input is a 400
with an OpenAI error body naming the field; nothing invalid reaches a rank. The generation
endpoints themselves are ``generation_api.py``; in ``corefleet serve`` their POSTs never
reach this app (the coordinator's HTTP protocol serves them without ASGI:
``engine/entrypoints/http_protocol.py``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.routing import Route

from corefleet.engine.openai.admission import read_body
from corefleet.engine.openai.errors import RequestError
from corefleet.engine.openai.front import ApiFront, Endpoint, error_response, reply_response
from corefleet.engine.openai.generation_api import Endpoint as GenerationEndpoint
from corefleet.engine.openai.generation_api import GenerationApi
from corefleet.engine.openai.openapi import served_openapi
from corefleet.engine.openai.responses_api import ResponsesApi
from corefleet.engine.openai.server_state import ServerState
from corefleet.engine.openai.utility_api import add_utility_routes

# FastAPI's built-in OpenTelemetry (in the versions that have it) asks the global providers
# on every request whether anyone listens, reading environment variables each time: a tenth of
# a short request's CPU here. The coordinator configures no tracing, so it is off.
_WITHOUT_TELEMETRY: dict[str, Any] = (
    {"telemetry": {"tracing": False, "metrics": False, "logs": False}}
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters
    else {}
)


def build_app(state: ServerState, api: GenerationApi | None = None) -> ApiFront:
    """The HTTP application over ``state.fleet``: FastAPI behind the front door (``front.py``:
    the key check, and the generation routes served ahead of FastAPI's layers). ``api`` serves
    the generation POSTs (one over ``state`` when not given); the coordinator's own HTTP
    protocol calls it directly, so those POSTs reach this app only under another server."""
    app = FastAPI(title="corefleet", docs_url=None, redoc_url=None, **_WITHOUT_TELEMETRY)
    # --root-path, set as vLLM sets it (FastAPI deprecates the constructor's argument): every
    # request's scope carries it, and Starlette routes paths with or without it.
    root_path = app.root_path = state.server.root_path
    api = api or GenerationApi(state)
    responses = ResponsesApi(api)
    api.endpoints.update(responses.endpoints)

    # The front door serves their POSTs; in FastAPI's table (plain Starlette routes: no
    # dependency solving) they answer other methods with 405. Their OpenAPI description is
    # written by hand (``openapi.py``).
    generation = {path: _over_asgi(state, fn) for path, fn in api.endpoints.items()}
    app.router.routes[:0] = [Route(path, fn, methods=["POST"]) for path, fn in generation.items()]

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> Response:
        return _stored(lambda: responses.get(response_id))

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> Response:
        return _stored(lambda: responses.delete(response_id))

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> Response:
        counts = state.fleet.membership.counts()
        ok = counts["ready"] > 0 and not state.shutting_down
        return JSONResponse({"ready": ok, "ranks": counts}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/admin/engines")
    async def engines() -> list[dict[str, Any]]:
        return [_rank_json(m) for m in state.fleet.membership.members.values()]

    add_utility_routes(app, state)

    def document() -> dict[str, Any]:
        served = served_openapi(
            state.model_name,
            bool(state.api_keys),
            state.max_n(),
            state.limits,
            state.fleet.membership.accepting(),
            tokenizer_info=state.server.enable_tokenizer_info_endpoint,
        )
        # The cached document is shared: a copy names the proxy's prefix (FastAPI's servers).
        return served | {"servers": [{"url": root_path}]} if root_path else served

    app.openapi = document  # type: ignore[method-assign]
    return ApiFront(
        app,
        state.api_keys,
        generation,
        closing=lambda: state.shutting_down,
        root_path=root_path,
    )


def _over_asgi(state: ServerState, endpoint: GenerationEndpoint) -> Endpoint:
    """``endpoint`` as an ASGI handler: the body read within the limits, the reply sent."""
    limits = state.limits

    async def handler(request: Request) -> Response:
        try:
            raw = await read_body(request, limits.max_request_body_bytes, limits.body_timeout_s)
        except RequestError as err:
            return error_response(err)
        return reply_response(await endpoint(raw, request.state.key_id))

    return handler


def _stored(read: Callable[[], dict[str, Any]]) -> Response:
    """A stored response's JSON, or the error finding it gave."""
    try:
        return JSONResponse(read())
    except RequestError as err:
        return error_response(err)


def _rank_json(member: Any) -> dict[str, Any]:
    info, stats = member.info, member.stats
    return {
        "rank": member.rank,
        "state": member.state.value,
        "pod_name": member.pod_name,
        "pid": member.pid,
        "incarnation": member.incarnation,
        "kv_cache_tokens": info.kv_cache_size_tokens if info else None,
        "max_model_len": info.max_model_len if info else None,
        "dp_size": info.dp_size if info else None,  # > 1: a rank of an MoE group
        "stats": None
        if stats is None
        else {
            "waiting": stats.num_waiting_reqs,
            "running": stats.num_running_reqs,
            "kv_cache_usage": stats.kv_cache_usage,
            "prefix_cache_hit_rate": stats.prefix_cache_hit_rate,
            "draining": stats.draining,
            "steps": stats.step_counter,
            "dummy_steps": stats.dummy_steps,
            "current_wave": stats.current_wave,
            "wave_running": stats.wave_running,
        },
        "dead_reason": member.dead_reason or None,
    }
