"""OpenAI responses from a generation's deltas: one final object, or a stream of chunks.

Each function folds :class:`Generation` deltas into the shape its endpoint returns (completions
or chat; whole or streamed as server-sent events) and records latency and token metrics.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
from pydantic import BaseModel

from corefleet.engine.openai import protocol as p
from corefleet.engine.openai.api_options import DEFAULT_API_OPTIONS, ApiOptions
from corefleet.engine.openai.chat_render import echoed_text, response_role
from corefleet.engine.openai.echo import CompletionEcho, prompt_logprobs_entries
from corefleet.engine.openai.errors import SSE_DONE, sse_event
from corefleet.engine.openai.logprobs import chat_logprobs, next_text_offset
from corefleet.engine.openai.metrics import ServingMetrics
from corefleet.engine.openai.serving import ChoiceDelta, Generation
from corefleet.engine.openai.token_request import ALL_REPORTED
from corefleet.engine.openai.tool_output import StreamedCalls, tool_finish_reason, whole_message
from corefleet.engine.openai.tool_request import NO_TOOLS, ToolPlan

_JSON = msgspec.json.Encoder()


def _timed(metrics: ServingMetrics, generation: Generation) -> AsyncIterator[ChoiceDelta]:
    """The generation's deltas; its engine outputs feed the request-level metrics on the way
    (``request_metrics.py``)."""
    generation.observer = metrics.request_stats(generation)
    return generation.deltas()


def _usage(generation: Generation, completion_tokens: int, details: bool = False) -> p.UsageInfo:
    """``details``: --enable-prompt-tokens-details (the prompt tokens the cache served)."""
    usage = p.UsageInfo(
        prompt_tokens=generation.num_prompt_tokens, completion_tokens=completion_tokens
    )
    cached = generation.num_cached_tokens if details else 0
    if cached:  # as vLLM: left out when the cache served none
        usage.prompt_tokens_details = p.PromptTokenUsageInfo(cached_tokens=cached)
    return usage


@dataclass(frozen=True)
class Shape:
    """What a request asked its answer to carry beyond the text (vLLM's fields and flags)."""

    top_k: int | None  # logprobs: how many alternatives per token; None: no logprobs
    as_ids: bool  # return_tokens_as_token_ids: tokens named "token_id:<id>"
    token_ids: bool  # return_token_ids: the prompt's and the answer's ids
    final_usage: bool  # a stream ends with a usage chunk (include_usage)
    chunk_usage: bool  # every chunk carries its choice's usage so far (continuous_usage_stats)

    @classmethod
    def of(
        cls,
        body: p.CompletionRequest | p.ChatCompletionRequest,
        generation: Generation,
        options: ApiOptions,
    ) -> Shape:
        stream = body.stream_options
        forced = options.enable_force_include_usage
        final = forced or bool(stream and stream.include_usage)
        as_ids = body.return_tokens_as_token_ids
        return cls(
            # With logprob_token_ids: every token the engine reported, the sampled one too
            # (vLLM's "return all"); their ranks are their places in the list.
            top_k=(
                ALL_REPORTED if generation.params.logprob_token_ids else generation.params.logprobs
            ),
            as_ids=options.return_tokens_as_token_ids if as_ids is None else as_ids,
            token_ids=bool(body.return_token_ids),
            final_usage=final,
            # As vLLM: continuous stats only ever come with the final usage.
            chunk_usage=final and (forced or bool(stream and stream.continuous_usage_stats)),
        )


async def completion_response(
    model_name: str,
    metrics: ServingMetrics,
    body: p.CompletionRequest,
    generation: Generation,
    options: ApiOptions = DEFAULT_API_OPTIONS,
) -> dict[str, Any]:
    shape = Shape.of(body, generation, options)
    choices: dict[int, p.CompletionChoice] = {}
    tokens = 0
    echo = CompletionEcho(body, generation)
    async for d in echo.deltas(_timed(metrics, generation)):
        choice = choices.get(d.index)
        if choice is None:
            choice = choices[d.index] = p.CompletionChoice(index=d.index, text="")
            choice.prompt_logprobs = prompt_logprobs_entries(d.prompt_logprobs)
            if shape.token_ids:
                choice.prompt_token_ids = generation.prompt_token_ids(d.index)
                choice.token_ids = []
        if shape.top_k is not None:
            offset = next_text_offset(choice.logprobs)
            more = echo.logprobs(d, shape.top_k, offset, shape.as_ids)
            choice.logprobs = _extend_completion(choice.logprobs, more)
        if choice.token_ids is not None:
            choice.token_ids += d.token_ids
        choice.text += d.text
        tokens += len(d.token_ids)
        if d.finish_reason is not None:
            choice.text = d.full_text if d.full_text is not None else choice.text
            choice.finish_reason = p.openai_finish_reason(d.finish_reason)
            choice.stop_reason = d.stop_reason
    response = p.CompletionResponse(
        model=model_name,
        choices=[choices[i] for i in sorted(choices)],
        usage=_usage(generation, tokens, options.enable_prompt_tokens_details),
    )
    return response.model_dump()


class _ChunkEvents:
    """A stream's SSE events. The fields every chunk shares (id, object, created, model) are
    encoded once; a chunk adds its one choice. The same JSON as dumping each chunk's model
    with nulls left out, at a fraction of the cost (a chunk per token per stream)."""

    def __init__(self, template: p.CompletionStreamResponse | p.ChatCompletionChunk) -> None:
        self.template = template
        shared = template.model_dump_json(exclude_none=True, exclude={"choices", "usage"})
        self._head = "data: " + shared[:-1] + ',"choices":['

    def choice(
        self,
        choice: dict[str, Any] | BaseModel,
        usage: p.UsageInfo | None = None,
        first: dict[str, Any] | None = None,
    ) -> str:
        """The event of a chunk holding ``choice``; in a dict, None values are left out.
        ``usage`` and (a chat stream's first chunk) the fields of ``first`` go beside it."""
        if isinstance(choice, BaseModel):
            encoded = choice.model_dump_json(exclude_none=True)
        else:
            encoded = _JSON.encode({k: v for k, v in choice.items() if v is not None}).decode()
        tail = "]"
        if usage is not None:
            tail += ',"usage":' + usage.model_dump_json()
        for name, value in (first or {}).items():
            tail += f',"{name}":' + _JSON.encode(value).decode()
        return self._head + encoded + tail + "}\n\n"

    def usage(self, usage: p.UsageInfo) -> str:
        return sse_event(self.template.model_copy(update={"usage": usage}))


async def completion_chunks(
    model_name: str,
    metrics: ServingMetrics,
    body: p.CompletionRequest,
    generation: Generation,
    options: ApiOptions = DEFAULT_API_OPTIONS,
) -> AsyncIterator[str]:
    shape = Shape.of(body, generation, options)
    events = _ChunkEvents(p.CompletionStreamResponse(model=model_name, choices=[]))
    tokens = 0
    counts = _ChoiceTokens(generation)
    offsets: dict[int, int] = {}
    echo = CompletionEcho(body, generation)
    async for d in echo.deltas(_timed(metrics, generation)):
        tokens += len(d.token_ids)
        first = counts.add(d.index, len(d.token_ids))
        usage = counts.usage(d.index) if shape.chunk_usage else None
        finish_reason = p.openai_finish_reason(d.finish_reason)
        if shape.top_k is None and not shape.token_ids:
            plain = {"index": d.index, "text": d.text, "finish_reason": finish_reason}
            yield events.choice(plain, usage)
            continue
        choice = p.CompletionChoice(index=d.index, text=d.text, finish_reason=finish_reason)
        if shape.top_k is not None:
            offset = offsets.get(d.index, 0)
            choice.logprobs = echo.logprobs(d, shape.top_k, offset, shape.as_ids)
            offsets[d.index] = next_text_offset(choice.logprobs, offset)
        if shape.token_ids:
            choice.token_ids = d.token_ids
            if first:
                choice.prompt_token_ids = generation.prompt_token_ids(d.index)
        yield events.choice(choice, usage)
    if shape.final_usage:
        yield events.usage(_usage(generation, tokens, options.enable_prompt_tokens_details))
    yield SSE_DONE


class _ChoiceTokens:
    """Each choice's tokens so far, for ``continuous_usage_stats``."""

    def __init__(self, generation: Generation) -> None:
        self.generation = generation
        self.tokens: dict[int, int] = {}

    def add(self, index: int, tokens: int) -> bool:
        """Count ``tokens`` more for choice ``index``; True on the choice's first delta."""
        first = index not in self.tokens
        self.tokens[index] = self.tokens.get(index, 0) + tokens
        return first

    def usage(self, index: int) -> p.UsageInfo:
        """The choice's usage so far: its prompt's tokens and the tokens it generated."""
        prompt = len(self.generation.prompt_token_ids(index))
        return p.UsageInfo(prompt_tokens=prompt, completion_tokens=self.tokens[index])


async def chat_response(
    model_name: str,
    metrics: ServingMetrics,
    body: p.ChatCompletionRequest,
    generation: Generation,
    tools: ToolPlan = NO_TOOLS,
    options: ApiOptions = DEFAULT_API_OPTIONS,
) -> dict[str, Any]:
    shape = Shape.of(body, generation, options)
    texts: dict[int, str] = {}
    ends: dict[int, tuple[str | None, int | str | None]] = {}
    logprobs: dict[int, p.ChatLogprobs] = {}
    token_ids: dict[int, list[int]] = {}
    tokens = 0
    prompt_logprobs = None  # vLLM's: one list per response, the prompt being the same
    async for d in _timed(metrics, generation):
        if d.prompt_logprobs is not None and prompt_logprobs is None:
            prompt_logprobs = prompt_logprobs_entries(d.prompt_logprobs)
        if shape.top_k is not None:
            more = chat_logprobs(d.token_ids, d.logprobs, shape.top_k, shape.as_ids)
            entry = logprobs.setdefault(d.index, p.ChatLogprobs(content=[]))
            if entry.content is None:
                entry.content = []
            entry.content.extend(more.content or [])
        texts[d.index] = texts.get(d.index, "") + d.text
        token_ids.setdefault(d.index, []).extend(d.token_ids)
        tokens += len(d.token_ids)
        if d.finish_reason is not None:
            texts[d.index] = d.full_text if d.full_text is not None else texts[d.index]
            ends[d.index] = (p.openai_finish_reason(d.finish_reason), d.stop_reason)
    choices = []
    for i in sorted(texts):
        reason, stop_reason = ends.get(i, (None, None))
        message = p.ChatResponseMessage(content=texts[i])
        if tools.reads_calls:
            message, called = whole_message(tools, texts[i], reason)
            reason = tool_finish_reason(tools, called, reason)
        message.role = response_role(body)
        if echoed := echoed_text(body):  # vLLM's chat echo: the last message, then the answer
            message.content = echoed + (message.content or "")
        choice = p.ChatChoice(
            index=i,
            message=message,
            logprobs=logprobs.get(i),
            finish_reason=reason,
            stop_reason=stop_reason,
            token_ids=token_ids[i] if shape.token_ids else None,
        )
        choices.append(choice)
    response = p.ChatCompletionResponse(
        model=model_name,
        choices=choices,
        usage=_usage(generation, tokens, options.enable_prompt_tokens_details),
        prompt_logprobs=prompt_logprobs,
    )
    for name, value in _chat_prompt_fields(body, generation, shape).items():
        setattr(response, name, value)
    return response.model_dump()


def _chat_prompt_fields(
    body: p.ChatCompletionRequest, generation: Generation, shape: Shape
) -> dict[str, Any]:
    """vLLM's prompt fields of a chat answer (a stream's first chunk): the rendered prompt's
    ids (``return_token_ids``) and text (``return_prompt_text``)."""
    fields: dict[str, Any] = {}
    if shape.token_ids:
        fields["prompt_token_ids"] = generation.prompt_token_ids(0)
    if body.return_prompt_text:
        fields["prompt_text"] = generation.prompt_text(0)
    return fields


async def chat_chunks(
    model_name: str,
    metrics: ServingMetrics,
    body: p.ChatCompletionRequest,
    generation: Generation,
    tools: ToolPlan = NO_TOOLS,
    options: ApiOptions = DEFAULT_API_OPTIONS,
) -> AsyncIterator[str]:
    shape = Shape.of(body, generation, options)
    top_k = shape.top_k
    events = _ChunkEvents(p.ChatCompletionChunk(model=model_name, choices=[]))
    started: set[int] = set()
    calls: dict[int, StreamedCalls] = {}
    tokens = 0
    counts = _ChoiceTokens(generation)
    first = _chat_prompt_fields(body, generation, shape) or None
    role, echoed = response_role(body), echoed_text(body)
    async for d in _timed(metrics, generation):
        tokens += len(d.token_ids)
        counts.add(d.index, len(d.token_ids))
        usage = counts.usage(d.index) if shape.chunk_usage else None
        finish_reason = p.openai_finish_reason(d.finish_reason)
        deltas: list[dict[str, Any]] = [{"content": d.text}]
        if tools.reads_calls:
            streamed = calls.setdefault(d.index, StreamedCalls(tools))
            deltas = streamed.feed(d.text)
            if finish_reason is not None:
                deltas += streamed.finish(finish_reason)
                finish_reason = tool_finish_reason(tools, streamed.calls > 0, finish_reason)
            if not deltas and (finish_reason or top_k is not None or d.index not in started):
                deltas = [{}]  # a chunk is still due: the role, the logprobs or the end
        if deltas and d.index not in started:  # the role comes once, in a choice's first chunk
            started.add(d.index)
            # With echo, the echoed message comes first, in a piece of its own (as in vLLM).
            head = {"role": role, "content": echoed} if echoed else {"role": role}
            deltas = [head, *deltas] if echoed else [head | deltas[0], *deltas[1:]]
        for k, delta in enumerate(deltas):
            last = k == len(deltas) - 1
            reason = finish_reason if last else None
            # The chunk's tokens, logprobs and usage go with its last piece.
            chunk_usage = usage if last else None
            if top_k is None and not shape.token_ids:
                plain = {"index": d.index, "delta": delta, "finish_reason": reason}
                yield events.choice(plain, chunk_usage, first)
                first = None  # the stream's first chunk alone carries them
                continue
            choice = p.ChatChunkChoice(
                index=d.index,
                delta=p.DeltaMessage.model_validate(delta),
                finish_reason=reason,
                token_ids=d.token_ids if last and shape.token_ids else None,
            )
            if last and top_k is not None:
                choice.logprobs = chat_logprobs(d.token_ids, d.logprobs, top_k, shape.as_ids)
            yield events.choice(choice, chunk_usage, first)
            first = None
    if shape.final_usage:
        yield events.usage(_usage(generation, tokens, options.enable_prompt_tokens_details))
    yield SSE_DONE


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
