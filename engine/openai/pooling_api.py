"""The pooling endpoints of a ``--runner pooling`` server: ``POST /v1/embeddings`` (OpenAI's
shape) and ``POST /pooling`` (vLLM's), a request body's bytes and the caller's key id in, a
:data:`Reply` out, like the generation endpoints (``generation_api``), whose table serves them.

Each input becomes one engine request carrying ``PoolingParams``; the fleet routes it like any
request, and its one output carries the vector (float32 bytes). Before anything is queued a
request passes the same admission as a generation: the number of inputs is bounded like
n × prompts (``--max-n``, a 400 naming ``input``), and counts among the requests in flight
(429). A server that generates answers these endpoints with a 404, as vLLM does (it mounts
them only for pooling models), and a pooling server answers the generation endpoints so.
"""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Any

import numpy as np

from corefleet.engine.frontend.input_processor import InputProcessor
from corefleet.engine.messages import (
    EngineCoreRequest,
    PoolerInfo,
    PoolingParams,
    ReadyResponse,
    SamplingParams,
    validate_prompt,
)
from corefleet.engine.openai.chat_render import check_chat_template_fields, render_chat
from corefleet.engine.openai.errors import RequestError, parse_request
from corefleet.engine.openai.pooling_protocol import (
    EmbeddingData,
    EmbeddingResponse,
    PoolingData,
    PoolingRequest,
    PoolingResponse,
    PoolingUsage,
)
from corefleet.engine.openai.replies import Reply, error_reply, json_reply
from corefleet.engine.openai.request_metrics import RequestStats
from corefleet.engine.openai.server_state import ServerState
from corefleet.engine.openai.serving import Generation
from corefleet.engine.openai.truncation import longest_prompt
from corefleet.engine.pooler_config import check_dimensions

# Inputs up to this many characters in all are tokenized on the event loop (as generation's).
INLINE_TOKENIZE_CHARS = 2048


def refuse_generation(info: ReadyResponse) -> None:
    """A 404 for a generation request to a pooling server (vLLM mounts no such route)."""
    if info.pooler is not None:
        raise RequestError(
            "this server runs --runner pooling: it serves POST /v1/embeddings and /pooling, "
            "not text generation",
            status=404,
            code="not_found",
        )


class PoolingApi:
    """``POST /v1/embeddings`` and ``POST /pooling`` over ``state``'s fleet."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.endpoints = {"/v1/embeddings": self.embeddings, "/pooling": self.pooling}

    async def embeddings(self, raw: bytes, key_id: str | None) -> Reply:
        """``POST /v1/embeddings``."""
        return await self._serve(raw, key_id, embeddings=True)

    async def pooling(self, raw: bytes, key_id: str | None) -> Reply:
        """``POST /pooling``."""
        return await self._serve(raw, key_id, embeddings=False)

    async def _serve(self, raw: bytes, key_id: str | None, *, embeddings: bool) -> Reply:
        state = self.state
        try:
            body = parse_request(PoolingRequest, raw)
            info, pooler = self._pooling_rank(body, embeddings)
            num_inputs = 1 if body.input is None else len(body.prompt_inputs())
            max_n = state.limits.effective_max_n(info.max_num_seqs)
            if num_inputs > max_n:
                raise RequestError(
                    f"the request has {num_inputs} inputs; this server allows at most {max_n} "
                    "per request (--max-n)",
                    param="input",
                )
            params = _pooling_params(body, pooler)
            if body.messages is not None:
                trusted = state.options.trust_request_chat_template
                check_chat_template_fields(body.chat_fields(), trusted)
            ticket = state.limiter.admit(key_id, num_inputs)
        except RequestError as err:
            return error_reply(err)
        try:
            requests = await self._requests(body, info, params)
            stats = state.metrics.pooling_stats(requests)
            vectors = await asyncio.gather(*(self._pool(r, stats) for r in requests))
        except RequestError as err:
            return error_reply(err)
        finally:
            ticket.release()
        num_tokens = sum(len(r.prompt_token_ids) for r in requests)
        usage = PoolingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)
        created = int(time.time())
        encoded = [_encode(v, body) for v in vectors]
        if embeddings:
            data = [EmbeddingData(index=i, embedding=e) for i, e in enumerate(encoded)]
            response: Any = EmbeddingResponse(
                created=created, model=state.model_name, data=data, usage=usage
            )
        else:
            items = [PoolingData(index=i, data=e) for i, e in enumerate(encoded)]
            response = PoolingResponse(
                created=created, model=state.model_name, data=items, usage=usage
            )
        return json_reply(response.model_dump())

    def _pooling_rank(
        self, body: PoolingRequest, embeddings: bool
    ) -> tuple[ReadyResponse, PoolerInfo]:
        """The ready ranks' description; 404 for another model or a generating server."""
        state = self.state
        state.check_model(body.model)
        info = state.engine_info()  # 503 while no rank is ready
        if info.pooler is None:
            path = "/v1/embeddings" if embeddings else "/pooling"
            raise RequestError(
                f"this server generates text (--runner generate): {path} needs a server "
                "started with --runner pooling",
                status=404,
                code="not_found",
            )
        return info, info.pooler

    async def _requests(
        self, body: PoolingRequest, info: ReadyResponse, params: PoolingParams
    ) -> list[EngineCoreRequest]:
        """Tokenized, truncated and validated engine requests, one per input (long texts are
        tokenized in a worker thread, as generation's)."""
        inputs = InputProcessor(self.state.tokenizer, info.max_model_len, info.vocab_size)
        longest = longest_prompt(body.truncate_prompt_tokens, info.max_model_len)
        field = "input" if body.input is not None else "messages"
        request_id = Generation.new_id()

        def build() -> list[EngineCoreRequest]:
            prompts = self._token_ids(body, inputs, longest is None)
            now = time.time()
            requests = []
            for i, ids in enumerate(prompts):
                if longest is not None:
                    ids = ids[-longest:]  # vLLM keeps the last tokens
                validate_prompt(ids, info.max_model_len, info.vocab_size)
                sampling = SamplingParams(max_tokens=1)  # unused: nothing is sampled
                requests.append(
                    EngineCoreRequest(
                        f"{request_id}-{i}",
                        ids,
                        sampling,
                        now,
                        body.priority,
                        pooling_params=params,
                    )
                )
            return requests

        try:
            if _text_chars(body) <= INLINE_TOKENIZE_CHARS:
                return build()
            return await asyncio.to_thread(build)
        except ValueError as exc:  # too long, empty, outside the vocabulary, a template's rule
            raise RequestError(str(exc), param=field, code=getattr(exc, "code", None)) from None

    def _token_ids(
        self, body: PoolingRequest, inputs: InputProcessor, check_length: bool
    ) -> list[list[int]]:
        tokenizer = self.state.tokenizer
        if body.messages is not None:
            fields = body.chat_fields()
            defaults = self.state.options.chat.default_chat_template_kwargs
            text = render_chat(tokenizer, body.template_messages(), fields, defaults=defaults)
            if check_length:
                inputs.check_text_length(text)
            return [tokenizer.encode(text, add_special_tokens=bool(fields.add_special_tokens))]
        add_special_tokens = body.add_special_tokens is not False
        out = []
        for prompt in body.prompt_inputs():
            if isinstance(prompt, str):
                if check_length:  # a text far too long is refused before tokenizing it
                    inputs.check_text_length(prompt)
                out.append(tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
            else:
                out.append(prompt["prompt_token_ids"])
        return out

    async def _pool(self, request: EngineCoreRequest, stats: RequestStats) -> np.ndarray:
        """Run one engine request; its vector ([D] float32). Its outputs feed the metrics."""
        async for stamped in self.state.fleet.generate_stamped(request):
            output = stamped.output
            stats.observe(stamped, str(output.finish_reason) if output.finished else None)
            if not output.finished:
                continue
            if output.pooling_output is None:
                raise RequestError(
                    f"the engine could not pool the input: {output.stop_reason or 'no vector'}",
                    status=500,
                )
            return np.frombuffer(output.pooling_output, dtype="<f4")
        raise RequestError("the engine request ended without a vector", status=500)


def _pooling_params(body: PoolingRequest, pooler: PoolerInfo) -> PoolingParams:
    """The request's pooling parameters (unset ones: the server's); 400 for ``dimensions``
    a model cannot give."""
    if body.dimensions is not None:
        try:
            check_dimensions(body.dimensions, pooler)
        except ValueError as exc:
            raise RequestError(str(exc), param="dimensions") from None
    return PoolingParams(dimensions=body.dimensions, use_activation=body.use_activation)


def _text_chars(body: PoolingRequest) -> int:
    if body.messages is not None:
        return sum(len(m.text()) for m in body.messages)
    return sum(len(p) for p in body.prompt_inputs() if isinstance(p, str))


def _encode(vector: np.ndarray, body: PoolingRequest) -> list[float] | str:
    """A vector as the response carries it: floats, or its bytes in ``embed_dtype`` and
    ``endianness``, base64-encoded (what the OpenAI client decodes with float32 defaults)."""
    if body.encoding_format == "float":
        return list(vector.tolist())
    order = {"native": "=", "big": ">", "little": "<"}[body.endianness]
    kind = {"float32": "f4", "float16": "f2"}[body.embed_dtype]
    return base64.b64encode(vector.astype(order + kind).tobytes()).decode()
