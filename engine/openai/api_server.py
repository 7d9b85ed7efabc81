"""The coordinator's HTTP API: OpenAI's completions, chat and models, plus health and metrics.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health`` (the process works), ``GET /ready`` (503, retryable, while no rank serves or
while shutting down), ``GET /metrics`` (Prometheus), ``GET /admin/engines`` (JSON per rank).
With an API key, ``/v1/*`` and ``/admin/*`` answer 401 without ``Authorization: Bearer KEY``.
Bad input is a 400 with an OpenAI error body naming the field; nothing invalid reaches a rank.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from corefleet.engine.coordinator.fleet_client import FleetClient
from corefleet.engine.frontend.input_processor import InputProcessor
from corefleet.engine.frontend.tokenizer import Tokenizer
from corefleet.engine.messages import ReadyResponse
from corefleet.engine.openai import protocol as p
from corefleet.engine.openai.admission import (
    RETRY_HEADERS,
    ApiKeys,
    InFlightLimiter,
    Ticket,
    read_body,
    unauthorized,
)
from corefleet.engine.openai.errors import SSE_DONE, RequestError, parse_request, sse_event
from corefleet.engine.openai.limits import FALLBACK_MAX_N, RequestLimits
from corefleet.engine.openai.logprobs import chat_logprobs, completion_logprobs
from corefleet.engine.openai.metrics import ServingMetrics
from corefleet.engine.openai.serving import ChoiceDelta, Generation


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

    def engine_info(self) -> ReadyResponse:
        ranks = self.fleet.membership.accepting()
        if self.shutting_down or not ranks or ranks[0].info is None:
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


def _error(err: RequestError) -> JSONResponse:
    headers = RETRY_HEADERS if err.status in (429, 503) else None
    return JSONResponse(err.to_response().model_dump(), status_code=err.status, headers=headers)


def build_app(state: ServerState) -> FastAPI:
    """The FastAPI application over ``state.fleet``."""
    app = FastAPI(title="corefleet", docs_url=None, redoc_url=None)

    @app.middleware("http")
    async def require_api_key(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        path = request.url.path
        request.state.key_id = None
        if state.api_keys and (path.startswith("/v1") or path.startswith("/admin")):
            request.state.key_id = state.api_keys.identify(request.headers.get("authorization"))
            if request.state.key_id is None:
                return _error(unauthorized())
        return await call_next(request)

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

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        try:
            body = parse_request(p.CompletionRequest, await _body(state, request))
            prompts = body.prompt_inputs()
            ticket = _admit(state, request, body, len(prompts))
        except RequestError as err:
            return _error(err)
        try:
            generation = await _start(state, body, prompts)
        except RequestError as err:
            ticket.release()
            return _error(err)
        if body.stream:
            return _sse(_released(ticket, _completion_chunks(state, body, generation)))
        try:
            return JSONResponse(await _completion_response(state, body, generation))
        finally:
            ticket.release()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        try:
            body = parse_request(p.ChatCompletionRequest, await _body(state, request))
            ticket = _admit(state, request, body, 1)
        except RequestError as err:
            return _error(err)
        try:
            generation = await _start(state, body, [_ChatPrompt(body.template_messages())])
        except RequestError as err:
            ticket.release()
            return _error(err)
        if body.stream:
            return _sse(_released(ticket, _chat_chunks(state, body, generation)))
        try:
            return JSONResponse(await _chat_response(state, body, generation))
        finally:
            ticket.release()

    return app


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
    n = body.n or 1
    best_of = getattr(body, "best_of", None) or n
    max_n = state.max_n()
    if max(n, best_of) * num_prompts > max_n:
        param = "n" if max(n, best_of) > max_n or num_prompts == 1 else "prompt"
        raise RequestError(
            f"{param}: the request asks for {max(n, best_of) * num_prompts} completions "
            f"({num_prompts} prompt(s) × n={max(n, best_of)}); this server allows at most "
            f"{max_n} per request (--max-n)",
            param=param,
        )
    return state.limiter.admit(request.state.key_id, n * num_prompts)


@dataclass
class _ChatPrompt:
    """A conversation, rendered and tokenized off the event loop like a text prompt."""

    messages: list[dict[str, str]]


async def _start(
    state: ServerState,
    body: p.CompletionRequest | p.ChatCompletionRequest,
    prompts: list[Any],
) -> Generation:
    """Tokenize and validate in a worker thread (a long prompt takes a while to tokenize and
    must not stall every other request), then start the generation."""
    info = state.engine_info()
    params = p.to_sampling_params(body, info.vocab_size)
    inputs = InputProcessor(state.tokenizer, info.max_model_len, info.vocab_size)
    request_id = Generation.new_id()

    def build() -> Generation:
        rendered = [_render(state.tokenizer, inputs, x) for x in prompts]
        return Generation(state.fleet, state.tokenizer, inputs, rendered, params, request_id)

    try:
        return await asyncio.to_thread(build)
    except ValueError as exc:  # a prompt too long, or a template refusing the conversation
        param = "messages" if isinstance(body, p.ChatCompletionRequest) else "prompt"
        raise RequestError(str(exc), param=param) from None


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


async def _timed(state: ServerState, generation: Generation) -> AsyncIterator[ChoiceDelta]:
    """The generation's deltas, recording latency and token metrics on the way."""
    started = last = time.monotonic()
    first = True
    state.metrics.prompt_tokens.inc(generation.num_prompt_tokens)
    async for delta in generation.deltas():
        now = time.monotonic()
        if delta.token_ids:
            (state.metrics.ttft if first else state.metrics.itl).observe(now - last)
            first, last = False, now
            state.metrics.generation_tokens.inc(len(delta.token_ids))
        yield delta
    state.metrics.e2e.observe(time.monotonic() - started)


def _usage(generation: Generation, completion_tokens: int) -> p.UsageInfo:
    return p.UsageInfo(
        prompt_tokens=generation.num_prompt_tokens, completion_tokens=completion_tokens
    )


async def _completion_response(
    state: ServerState, body: p.CompletionRequest, generation: Generation
) -> dict[str, Any]:
    choices: dict[int, p.CompletionChoice] = {}
    tokens = 0
    top_k = generation.params.logprobs
    async for d in _timed(state, generation):
        choice = choices.setdefault(d.index, p.CompletionChoice(index=d.index, text=""))
        if top_k is not None:
            more = completion_logprobs(d.token_ids, d.logprobs, top_k, len(choice.text))
            choice.logprobs = _extend_completion(choice.logprobs, more)
        choice.text += d.text
        tokens += len(d.token_ids)
        if d.finish_reason is not None:
            choice.text = d.full_text if d.full_text is not None else choice.text
            choice.finish_reason = p.openai_finish_reason(d.finish_reason)
            choice.stop_reason = d.stop_reason
    response = p.CompletionResponse(
        model=state.model_name,
        choices=[choices[i] for i in sorted(choices)],
        usage=_usage(generation, tokens),
    )
    return response.model_dump()


async def _completion_chunks(
    state: ServerState, body: p.CompletionRequest, generation: Generation
) -> AsyncIterator[str]:
    template = p.CompletionStreamResponse(model=state.model_name, choices=[])
    tokens = 0
    top_k = generation.params.logprobs
    offsets: dict[int, int] = {}
    async for d in _timed(state, generation):
        tokens += len(d.token_ids)
        choice = p.CompletionChoice(
            index=d.index, text=d.text, finish_reason=p.openai_finish_reason(d.finish_reason)
        )
        if top_k is not None:
            offset = offsets.get(d.index, 0)
            choice.logprobs = completion_logprobs(d.token_ids, d.logprobs, top_k, offset)
        offsets[d.index] = offsets.get(d.index, 0) + len(d.text)
        yield sse_event(template.model_copy(update={"choices": [choice]}))
    if body.stream_options and body.stream_options.include_usage:
        yield sse_event(template.model_copy(update={"usage": _usage(generation, tokens)}))
    yield SSE_DONE


async def _chat_response(
    state: ServerState, body: p.ChatCompletionRequest, generation: Generation
) -> dict[str, Any]:
    texts: dict[int, str] = {}
    ends: dict[int, tuple[str | None, int | str | None]] = {}
    logprobs: dict[int, p.ChatLogprobs] = {}
    tokens = 0
    top_k = generation.params.logprobs
    async for d in _timed(state, generation):
        if top_k is not None:
            content = chat_logprobs(d.token_ids, d.logprobs, top_k).content or []
            entry = logprobs.setdefault(d.index, p.ChatLogprobs(content=[]))
            if entry.content is None:
                entry.content = []
            entry.content.extend(content)
        texts[d.index] = texts.get(d.index, "") + d.text
        tokens += len(d.token_ids)
        if d.finish_reason is not None:
            texts[d.index] = d.full_text if d.full_text is not None else texts[d.index]
            ends[d.index] = (p.openai_finish_reason(d.finish_reason), d.stop_reason)
    choices = [
        p.ChatChoice(
            index=i,
            message=p.ChatResponseMessage(content=texts[i]),
            logprobs=logprobs.get(i),
            finish_reason=ends.get(i, (None, None))[0],
            stop_reason=ends.get(i, (None, None))[1],
        )
        for i in sorted(texts)
    ]
    response = p.ChatCompletionResponse(
        model=state.model_name, choices=choices, usage=_usage(generation, tokens)
    )
    return response.model_dump()


async def _chat_chunks(
    state: ServerState, body: p.ChatCompletionRequest, generation: Generation
) -> AsyncIterator[str]:
    template = p.ChatCompletionChunk(model=state.model_name, choices=[])
    started: set[int] = set()
    tokens = 0
    async for d in _timed(state, generation):
        tokens += len(d.token_ids)
        delta = p.DeltaMessage(content=d.text)
        if d.index not in started:  # the role comes once, in a choice's first chunk
            started.add(d.index)
            delta.role = "assistant"
        choice = p.ChatChunkChoice(
            index=d.index, delta=delta, finish_reason=p.openai_finish_reason(d.finish_reason)
        )
        if generation.params.logprobs is not None:
            choice.logprobs = chat_logprobs(d.token_ids, d.logprobs, generation.params.logprobs)
        yield sse_event(template.model_copy(update={"choices": [choice]}))
    if body.stream_options and body.stream_options.include_usage:
        yield sse_event(template.model_copy(update={"usage": _usage(generation, tokens)}))
    yield SSE_DONE


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


def _extend_completion(
    so_far: p.CompletionLogprobs | None, more: p.CompletionLogprobs
) -> p.CompletionLogprobs:
    if so_far is None:
        return more
    so_far.tokens += more.tokens
    so_far.token_logprobs += more.token_logprobs
    so_far.top_logprobs += more.top_logprobs
    so_far.text_offset += more.text_offset
    return so_far
