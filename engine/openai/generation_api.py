"""The generation endpoints (``POST /v1/completions`` and ``/v1/chat/completions``), apart
from HTTP: a request body's bytes and the caller's key id in, a :data:`Reply` out.

Before a request costs anything it passes ``admission``: its ``n`` × prompts (``--max-n``) and
its place among the completions in flight (429); a long prompt is then tokenized in a worker
thread. Bad input is a 400 with an OpenAI error body naming the field; nothing invalid reaches
a rank. The coordinator's HTTP protocol calls :meth:`GenerationApi.serve` directly (no ASGI on
this path); ``api_server.build_app`` calls the same methods for the ASGI app.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from corefleet.engine.frontend.input_processor import InputProcessor
from corefleet.engine.frontend.tokenizer import Tokenizer
from corefleet.engine.messages import ReadyResponse
from corefleet.engine.openai import protocol as p
from corefleet.engine.openai.admission import Ticket, unauthorized
from corefleet.engine.openai.beam_api import beam_reply, check_beam_request
from corefleet.engine.openai.chat_render import (
    ChatTemplateFields,
    check_chat_template_fields,
    render_chat,
)
from corefleet.engine.openai.errors import RequestError, parse_request
from corefleet.engine.openai.extra_fields import check_extra_fields
from corefleet.engine.openai.pooling_api import PoolingApi, refuse_generation
from corefleet.engine.openai.replies import Reply, StreamReply, error_reply, json_reply
from corefleet.engine.openai.responses import (
    chat_chunks,
    chat_response,
    completion_chunks,
    completion_response,
)
from corefleet.engine.openai.sampling_request import to_sampling_params
from corefleet.engine.openai.server_state import ServerState
from corefleet.engine.openai.serving import Generation
from corefleet.engine.openai.structured_request import check_constraint, constraint_chars
from corefleet.engine.openai.tool_request import NO_TOOLS, ToolPlan, plan_tools
from corefleet.engine.openai.truncation import longest_prompt, truncated

# Prompts up to this many characters are tokenized on the event loop: ~0.1 ms at most, less
# than a hand-off to a worker thread and back.
INLINE_TOKENIZE_CHARS = 2048

Endpoint = Callable[[bytes, str | None], Awaitable[Reply]]


class GenerationApi:
    """The two generation endpoints over ``state``'s fleet."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.endpoints: dict[str, Endpoint] = {
            "/v1/completions": self.completions,
            "/v1/chat/completions": self.chat,
        }
        # --runner pooling's endpoints, served the same way (``pooling_api``).
        self.endpoints.update(PoolingApi(state).endpoints)

    def closing(self) -> bool:
        """True once the server shuts down: every answer then closes its connection."""
        return self.state.shutting_down

    async def serve(self, path: str, body: bytes, authorization: str | None) -> Reply:
        """The answer to a POST of ``body`` to ``path`` (one of :attr:`endpoints`), after the
        key check (401 without a valid key, when keys are configured)."""
        key_id = None
        if self.state.api_keys:
            key_id = self.state.api_keys.identify(authorization)
            if key_id is None:
                return error_reply(unauthorized())
        return await self.endpoints[path](body, key_id)

    async def completions(self, raw: bytes, key_id: str | None) -> Reply:
        """``POST /v1/completions``."""
        try:
            body = parse_request(p.CompletionRequest, raw)
            check_extra_fields(body.model_extra, "completions")
        except RequestError as err:
            return error_reply(err)
        return await self._generate(key_id, body, body.prompt_inputs())

    async def chat(self, raw: bytes, key_id: str | None) -> Reply:
        """``POST /v1/chat/completions``."""
        try:
            body = parse_request(p.ChatCompletionRequest, raw)
            prompt, tools = self.chat_prompt(body)
        except RequestError as err:
            return error_reply(err)
        return await self._generate(key_id, body, [prompt], tools)

    def chat_prompt(self, body: p.ChatCompletionRequest) -> tuple[Any, ToolPlan]:
        """The prompt (rendered when it starts) and the tool plan of a parsed chat request;
        also the Responses API's (``responses_api.py``), which is a chat request in another
        shape.

        Raises:
            RequestError: a field the server refuses, a bad tool or template option.
        """
        check_extra_fields(body.model_extra, "chat")
        tools = plan_tools(
            body.tools, body.tool_choice, body.parallel_tool_calls, self.state.tool_options
        )
        check_chat_template_fields(body, self.state.options.trust_request_chat_template)
        defaults = self.state.options.chat.default_chat_template_kwargs
        return _ChatPrompt(body.template_messages(), body, tools, defaults), tools

    async def start(
        self,
        key_id: str | None,
        body: p.CompletionRequest | p.ChatCompletionRequest,
        prompts: list[Any],
        tools: ToolPlan = NO_TOOLS,
    ) -> tuple[Ticket, Generation]:
        """Admit and start one generation request. The caller releases the ticket once the
        answer is complete, the stream ends or the client goes away.

        Raises:
            RequestError: refused (404, 400, 429, 503...); nothing is held then.
        """
        ticket, info = _admit(self.state, key_id, body, len(prompts))
        try:
            return ticket, await _start(self.state, info, body, prompts, tools)
        except RequestError:
            ticket.release()
            raise

    async def _generate(
        self,
        key_id: str | None,
        body: p.CompletionRequest | p.ChatCompletionRequest,
        prompts: list[Any],
        tools: ToolPlan = NO_TOOLS,
    ) -> Reply:
        """Admit, start and answer one generation request. Its place among the requests in
        flight is held until the answer is complete, the stream ends or the client goes away."""
        state = self.state
        try:
            ticket, generation = await self.start(key_id, body, prompts, tools)
        except RequestError as err:
            return error_reply(err)
        if body.use_beam_search:
            try:
                constrained = generation.params.structured_outputs is not None
                structured = constrained or tools.reads_calls
                check_beam_request(body, structured, generation.inputs.max_logprobs)
                return await beam_reply(state, body, generation)
            except RequestError as err:
                return error_reply(err)
            finally:
                ticket.release()
        name, metrics, options = state.model_name, state.metrics, state.options
        if body.stream:
            if isinstance(body, p.CompletionRequest):
                events = completion_chunks(name, metrics, body, generation, options)
            else:
                events = chat_chunks(name, metrics, body, generation, tools, options)
            return StreamReply(_released(ticket, events))
        try:
            if isinstance(body, p.CompletionRequest):
                answer = await completion_response(name, metrics, body, generation, options)
            else:
                answer = await chat_response(name, metrics, body, generation, tools, options)
            return json_reply(answer)
        finally:
            ticket.release()


def _admit(
    state: ServerState,
    key_id: str | None,
    body: p.CompletionRequest | p.ChatCompletionRequest,
    num_prompts: int,
) -> tuple[Ticket, ReadyResponse]:
    """Checks that need no tokenizing, then a place among the requests in flight (or 429).
    Also returns what the first ready rank said of itself (limits, vocabulary)."""
    state.check_model(body.model)
    info = state.engine_info()  # 503 while no rank is ready
    refuse_generation(info)  # 404 from a --runner pooling server
    _check_choices(body, num_prompts, state.limits.effective_max_n(info.max_num_seqs))
    return state.limiter.admit(key_id, (body.n or 1) * num_prompts), info


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

    messages: list[dict[str, Any]]
    fields: ChatTemplateFields  # the request's chat-template options
    tools: ToolPlan = NO_TOOLS
    defaults: dict[str, Any] | None = None  # --default-chat-template-kwargs


async def _start(
    state: ServerState,
    info: ReadyResponse,
    body: p.CompletionRequest | p.ChatCompletionRequest,
    prompts: list[Any],
    tools: ToolPlan,
) -> Generation:
    """Tokenize and validate, then start the generation. Long prompts go to a worker thread
    (tokenizing them takes a while and must not stall every other request); short ones are
    tokenized at once, since handing them to a thread costs more than tokenizing them."""
    params = to_sampling_params(
        body, info.vocab_size, tools.constraint, state.structured_outputs, info.max_logprobs
    )
    inputs = InputProcessor(state.tokenizer, info.max_model_len, info.vocab_size, info.max_logprobs)
    request_id = Generation.new_id()
    keep = longest_prompt(body.truncate_prompt_tokens, info.max_model_len)
    priority = _priority(body.priority, info)

    def build() -> Generation:
        check_constraint(params.structured_outputs, body)  # a grammar's own check: a 400
        rendered = [_render(state.tokenizer, inputs, x, keep is None) for x in prompts]
        if keep is not None:
            side = body.truncation_side
            rendered = [truncated(state.tokenizer, x, keep, side) for x in rendered]
        return Generation(
            state.fleet,
            state.tokenizer,
            inputs,
            rendered,
            params,
            request_id,
            body.cache_salt,
            priority,
        )

    try:
        heavy = _text_chars(prompts) + constraint_chars(params.structured_outputs)
        if heavy <= INLINE_TOKENIZE_CHARS:
            return build()
        return await asyncio.to_thread(build)
    except ValueError as exc:  # a prompt too long, or a template refusing the conversation
        # A refusal no JSON Schema can foresee (too many tokens, a template's rule) carries
        # the code the OpenAPI document lists for it.
        code = getattr(exc, "code", None)
        raise RequestError(str(exc), param=_blamed_field(body, str(exc)), code=code) from None


def _priority(priority: int | None, info: ReadyResponse) -> int:
    """The request's priority; a 400 for one the ranks would not honour, as vLLM refuses a
    priority other than 0 without priority scheduling."""
    if priority and info.scheduling_policy != "priority":
        raise RequestError(
            f"priority={priority} needs ranks started with --scheduling-policy priority "
            f"(these schedule {info.scheduling_policy})",
            param="priority",
        )
    return priority or 0


def _text_chars(prompts: list[Any]) -> int:
    """The characters of text a request's prompts hold (token id lists hold none)."""
    total = 0
    for prompt in prompts:
        if isinstance(prompt, str):
            total += len(prompt)
        elif isinstance(prompt, _ChatPrompt):
            total += sum(len(str(m.get("content") or "")) for m in prompt.messages)
            total += sum(len(str(t.function.parameters or "")) for t in prompt.tools.tools)
            total += len(prompt.fields.chat_template or "")
            total += len(str(prompt.fields.chat_template_kwargs or ""))
            total += len(str(prompt.fields.documents or ""))
        elif isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            total += len(prompt["prompt"])
    return total


def _blamed_field(body: p.CompletionRequest | p.ChatCompletionRequest, message: str) -> str:
    """The request field a prompt-processing error is about, as the client named it."""
    if message.startswith("max_tokens="):  # the output budget does not fit the context
        chat_budget = getattr(body, "max_completion_tokens", None)
        return "max_tokens" if chat_budget is None else "max_completion_tokens"
    return "messages" if isinstance(body, p.ChatCompletionRequest) else "prompt"


def _render(
    tokenizer: Tokenizer, inputs: InputProcessor, prompt: Any, check_length: bool = True
) -> Any:
    """A chat prompt rendered and tokenized; a text or token-id prompt as it is.
    ``check_length``: refuse a text too long for the context before tokenizing it (not when
    the prompt is to be truncated)."""
    if not isinstance(prompt, _ChatPrompt):
        return prompt
    text = render_chat(tokenizer, prompt.messages, prompt.fields, prompt.tools, prompt.defaults)
    if check_length:
        inputs.check_text_length(text)
    ids = tokenizer.encode(text, add_special_tokens=bool(prompt.fields.add_special_tokens))
    return {"prompt": text, "prompt_token_ids": ids}


async def _released(ticket: Ticket, events: AsyncIterator[str]) -> AsyncIterator[str]:
    """``events``, giving the ticket back when the stream ends, fails or is abandoned."""
    try:
        async for event in events:
            yield event
    finally:
        ticket.release()
