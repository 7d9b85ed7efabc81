"""The coordinator's HTTP API: OpenAI's completions, chat and models, plus health and metrics.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health`` (the process works), ``GET /ready`` (503, retryable, while no rank serves or
while shutting down), ``GET /metrics`` (Prometheus), ``GET /admin/engines`` (JSON per rank),
``GET /openapi.json`` (``openapi.py``). With API keys, ``/v1/*`` and ``/admin/*`` answer 401
without ``Authorization: Bearer KEY``. Bad input is a 400 with an OpenAI error body naming the
field; nothing invalid reaches a rank. Before a request costs anything it passes
``admission``: its body's size (413), its ``n`` × prompts (``--max-n``), and its place among
the completions in flight (429); a long prompt is then tokenized in a worker thread.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from corefleet.engine.coordinator.fleet_client import FleetClient
from corefleet.engine.frontend.input_processor import InputProcessor
from corefleet.engine.frontend.tokenizer import Tokenizer
from corefleet.engine.messages import ReadyResponse
from corefleet.engine.openai import protocol as p
from corefleet.engine.openai.admission import (
    ApiKeys,
    InFlightLimiter,
    Ticket,
    read_body,
)
from corefleet.engine.openai.errors import RequestError, parse_request
from corefleet.engine.openai.front import ApiFront, error_response
from corefleet.engine.openai.limits import FALLBACK_MAX_N, RequestLimits
from corefleet.engine.openai.metrics import ServingMetrics
from corefleet.engine.openai.openapi import served_openapi
from corefleet.engine.openai.responses import (
    chat_chunks,
    chat_response,
    completion_chunks,
    completion_response,
)
from corefleet.engine.openai.serving import Generation

# FastAPI's built-in OpenTelemetry (in the versions that have it) asks the global providers
# on every request whether anyone listens, reading environment variables each time: a tenth of
# a short request's CPU here. The coordinator configures no tracing, so it is off.
_WITHOUT_TELEMETRY: dict[str, Any] = (
    {"telemetry": {"tracing": False, "metrics": False, "logs": False}}
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters
    else {}
)

# Prompts up to this many characters are tokenized on the event loop: ~0.1 ms at most, less
# than a hand-off to a worker thread and back.
INLINE_TOKENIZE_CHARS = 2048


@dataclass
class ServerState:
    """What the HTTP handlers share: the fleet, the tokenizer, the keys and the limits."""

    fleet: FleetClient
    tokenizer: Tokenizer
    model_name: str
    api_keys: ApiKeys
    metrics: ServingMetrics
    limits: RequestLimits = field(default_factory=RequestLimits)
    shutting_down: bool = False

    def __post_init__(self) -> None:
        self.limiter = InFlightLimiter(
            self.max_concurrent, self.limits.max_concurrent_requests_per_key
        )
        self.metrics.watch_admission(self.limiter)

    def engine_info(self) -> ReadyResponse:
        # A coordinator shutting down still serves what reaches it (its readiness sends new
        # clients elsewhere, and each response closes its connection): refusing would fail
        # requests that a rolling update must not fail.
        ranks = self.fleet.membership.accepting()
        if not ranks or ranks[0].info is None:
            raise RequestError(
                "no engine rank is ready yet; retry shortly", status=503, type="server_error"
            )
        return ranks[0].info

    def max_n(self) -> int:
        """The most completions one request may ask for now (``--max-n`` or the ranks')."""
        ranks = self.fleet.membership.accepting()
        info = ranks[0].info if ranks else None
        return self.limits.effective_max_n(info.max_num_seqs if info else None)

    def max_concurrent(self) -> int:
        """The server-wide bound on completions in flight, following the ready ranks."""
        total = sum(
            (m.info.max_num_seqs if m.info else 0) or FALLBACK_MAX_N
            for m in self.fleet.membership.accepting()
        )
        return self.limits.effective_max_concurrent(total or FALLBACK_MAX_N)


def build_app(state: ServerState) -> ApiFront:
    """The HTTP application over ``state.fleet``: FastAPI behind the front door (``front.py``:
    the key check, and the generation routes served ahead of FastAPI's layers)."""
    app = FastAPI(title="corefleet", docs_url=None, redoc_url=None, **_WITHOUT_TELEMETRY)

    async def completions(request: Request) -> Response:
        try:
            body = parse_request(p.CompletionRequest, await _body(state, request))
        except RequestError as err:
            return error_response(err)
        return await _generate(state, request, body, body.prompt_inputs())

    async def chat(request: Request) -> Response:
        try:
            body = parse_request(p.ChatCompletionRequest, await _body(state, request))
        except RequestError as err:
            return error_response(err)
        return await _generate(state, request, body, [_ChatPrompt(body.template_messages())])

    # The front door serves their POSTs; in FastAPI's table (plain Starlette routes: no
    # dependency solving) they answer other methods with 405. Their OpenAPI description is
    # written by hand (``openapi.py``).
    generation = {"/v1/completions": completions, "/v1/chat/completions": chat}
    app.router.routes[:0] = [Route(path, fn, methods=["POST"]) for path, fn in generation.items()]

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

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        ranks = state.fleet.membership.accepting()
        max_len = ranks[0].info.max_model_len if ranks and ranks[0].info else None
        card = p.ModelCard(id=state.model_name, max_model_len=max_len)
        return p.ModelList(data=[card]).model_dump()

    app.openapi = lambda: served_openapi(  # type: ignore[method-assign]
        state.model_name,
        bool(state.api_keys),
        state.max_n(),
        state.limits,
        state.fleet.membership.accepting(),
    )
    return ApiFront(app, state.api_keys, generation, closing=lambda: state.shutting_down)


async def _generate(
    state: ServerState,
    request: Request,
    body: p.CompletionRequest | p.ChatCompletionRequest,
    prompts: list[Any],
) -> Response:
    """Admit, start and answer one generation request. Its place among the requests in flight
    is held until the answer is complete, the stream ends or the client goes away."""
    try:
        ticket = _admit(state, request, body, len(prompts))
    except RequestError as err:
        return error_response(err)
    try:
        generation = await _start(state, body, prompts)
    except RequestError as err:
        ticket.release()
        return error_response(err)
    name, metrics = state.model_name, state.metrics
    if body.stream:
        if isinstance(body, p.CompletionRequest):
            return _sse(_released(ticket, completion_chunks(name, metrics, body, generation)))
        return _sse(_released(ticket, chat_chunks(name, metrics, body, generation)))
    try:
        if isinstance(body, p.CompletionRequest):
            return JSONResponse(await completion_response(name, metrics, body, generation))
        return JSONResponse(await chat_response(name, metrics, body, generation))
    finally:
        ticket.release()


async def _body(state: ServerState, request: Request) -> bytes:
    limits = state.limits
    return await read_body(request, limits.max_request_body_bytes, limits.body_timeout_s)


def _admit(
    state: ServerState,
    request: Request,
    body: p.CompletionRequest | p.ChatCompletionRequest,
    num_prompts: int,
) -> Ticket:
    """Checks that need no tokenizing, then a place among the requests in flight (or 429)."""
    if body.model is not None and body.model != state.model_name:
        raise RequestError(
            f"the model {body.model!r} does not exist; this server serves {state.model_name!r}",
            status=404,
            param="model",
            code="model_not_found",
        )
    state.engine_info()  # 503 while no rank is ready
    _check_choices(body, num_prompts, state.max_n())
    return state.limiter.admit(request.state.key_id, (body.n or 1) * num_prompts)


def _check_choices(
    body: p.CompletionRequest | p.ChatCompletionRequest, num_prompts: int, max_n: int
) -> None:
    """400 unless ``n``, ``best_of`` and n × prompts are all within ``max_n``."""
    best_of = getattr(body, "best_of", None)
    for param, value in (("n", body.n or 1), ("best_of", best_of or 1)):
        if value > max_n:
            raise RequestError(
                f"{param}={value}: this server allows at most {max_n} completions per request "
                "(--max-n)",
                param=param,
            )
    if (body.n or 1) * num_prompts > max_n:
        raise RequestError(
            f"the request asks for {(body.n or 1) * num_prompts} completions ({num_prompts} "
            f"prompts × n={body.n or 1}); this server allows at most {max_n} per request "
            "(--max-n)",
            param="prompt",
        )


@dataclass
class _ChatPrompt:
    """A conversation, rendered and tokenized off the event loop like a text prompt."""

    messages: list[dict[str, str]]


async def _start(
    state: ServerState,
    body: p.CompletionRequest | p.ChatCompletionRequest,
    prompts: list[Any],
) -> Generation:
    """Tokenize and validate, then start the generation. Long prompts go to a worker thread
    (tokenizing them takes a while and must not stall every other request); short ones are
    tokenized at once, since handing them to a thread costs more than tokenizing them."""
    info = state.engine_info()
    params = p.to_sampling_params(body, info.vocab_size)
    inputs = InputProcessor(state.tokenizer, info.max_model_len, info.vocab_size)
    request_id = Generation.new_id()

    def build() -> Generation:
        rendered = [_render(state.tokenizer, inputs, x) for x in prompts]
        return Generation(state.fleet, state.tokenizer, inputs, rendered, params, request_id)

    try:
        if _text_chars(prompts) <= INLINE_TOKENIZE_CHARS:
            return build()
        return await asyncio.to_thread(build)
    except ValueError as exc:  # a prompt too long, or a template refusing the conversation
        # A refusal no JSON Schema can foresee (too many tokens, a template's rule) carries
        # the code the OpenAPI document lists for it.
        code = getattr(exc, "code", None)
        raise RequestError(str(exc), param=_blamed_field(body, str(exc)), code=code) from None


def _text_chars(prompts: list[Any]) -> int:
    """The characters of text a request's prompts hold (token id lists hold none)."""
    total = 0
    for prompt in prompts:
        if isinstance(prompt, str):
            total += len(prompt)
        elif isinstance(prompt, _ChatPrompt):
            total += sum(len(str(m.get("content") or "")) for m in prompt.messages)
        elif isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            total += len(prompt["prompt"])
    return total


def _blamed_field(body: p.CompletionRequest | p.ChatCompletionRequest, message: str) -> str:
    """The request field a prompt-processing error is about, as the client named it."""
    if message.startswith("max_tokens="):  # the output budget does not fit the context
        chat_budget = getattr(body, "max_completion_tokens", None)
        return "max_tokens" if chat_budget is None else "max_completion_tokens"
    return "messages" if isinstance(body, p.ChatCompletionRequest) else "prompt"


def _render(tokenizer: Tokenizer, inputs: InputProcessor, prompt: Any) -> Any:
    if not isinstance(prompt, _ChatPrompt):
        return prompt
    text = tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True)
    inputs.check_text_length(text)
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}


async def _released(ticket: Ticket, events: AsyncIterator[str]) -> AsyncIterator[str]:
    """``events``, giving the ticket back when the stream ends, fails or is abandoned."""
    try:
        async for event in events:
            yield event
    finally:
        ticket.release()


def _sse(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream")


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
        "stats": None
        if stats is None
        else {
            "waiting": stats.num_waiting_reqs,
            "running": stats.num_running_reqs,
            "kv_cache_usage": stats.kv_cache_usage,
            "prefix_cache_hit_rate": stats.prefix_cache_hit_rate,
            "draining": stats.draining,
            "steps": stats.step_counter,
        },
        "dead_reason": member.dead_reason or None,
    }
