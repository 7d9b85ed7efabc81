"""OpenAI responses from a generation's deltas: one final object, or a stream of chunks.

Each function folds :class:`Generation` deltas into the shape its endpoint returns (completions
or chat; whole or streamed as server-sent events) and records latency and token metrics.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec
from pydantic import BaseModel

from corefleet.engine.openai import protocol as p
from corefleet.engine.openai.errors import SSE_DONE, sse_event
from corefleet.engine.openai.logprobs import chat_logprobs, completion_logprobs
from corefleet.engine.openai.metrics import ServingMetrics
from corefleet.engine.openai.serving import ChoiceDelta, Generation
from corefleet.engine.openai.tool_output import StreamedCalls, tool_finish_reason, whole_message
from corefleet.engine.openai.tool_request import NO_TOOLS, ToolPlan

_JSON = msgspec.json.Encoder()


def _timed(metrics: ServingMetrics, generation: Generation) -> AsyncIterator[ChoiceDelta]:
    """The generation's deltas; its engine outputs feed the request-level metrics on the way
    (``request_metrics.py``)."""
    generation.observer = metrics.request_stats(generation)
    return generation.deltas()


def _usage(generation: Generation, completion_tokens: int) -> p.UsageInfo:
    return p.UsageInfo(
        prompt_tokens=generation.num_prompt_tokens, completion_tokens=completion_tokens
    )


async def completion_response(
    model_name: str, metrics: ServingMetrics, body: p.CompletionRequest, generation: Generation
) -> dict[str, Any]:
    choices: dict[int, p.CompletionChoice] = {}
    tokens = 0
    top_k = generation.params.logprobs
    async for d in _timed(metrics, generation):
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
        model=model_name,
        choices=[choices[i] for i in sorted(choices)],
        usage=_usage(generation, tokens),
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

    def choice(self, choice: dict[str, Any] | BaseModel) -> str:
        """The event of a chunk holding ``choice``; in a dict, None values are left out."""
        if isinstance(choice, BaseModel):
            encoded = choice.model_dump_json(exclude_none=True)
        else:
            encoded = _JSON.encode({k: v for k, v in choice.items() if v is not None}).decode()
        return self._head + encoded + "]}\n\n"

    def usage(self, usage: p.UsageInfo) -> str:
        return sse_event(self.template.model_copy(update={"usage": usage}))


async def completion_chunks(
    model_name: str, metrics: ServingMetrics, body: p.CompletionRequest, generation: Generation
) -> AsyncIterator[str]:
    events = _ChunkEvents(p.CompletionStreamResponse(model=model_name, choices=[]))
    tokens = 0
    top_k = generation.params.logprobs
    offsets: dict[int, int] = {}
    async for d in _timed(metrics, generation):
        tokens += len(d.token_ids)
        finish_reason = p.openai_finish_reason(d.finish_reason)
        if top_k is None:
            yield events.choice({"index": d.index, "text": d.text, "finish_reason": finish_reason})
            continue
        offset = offsets.get(d.index, 0)
        offsets[d.index] = offset + len(d.text)
        logprobs = completion_logprobs(d.token_ids, d.logprobs, top_k, offset)
        choice = p.CompletionChoice(
            index=d.index, text=d.text, logprobs=logprobs, finish_reason=finish_reason
        )
        yield events.choice(choice)
    if body.stream_options and body.stream_options.include_usage:
        yield events.usage(_usage(generation, tokens))
    yield SSE_DONE


async def chat_response(
    model_name: str,
    metrics: ServingMetrics,
    body: p.ChatCompletionRequest,
    generation: Generation,
    tools: ToolPlan = NO_TOOLS,
) -> dict[str, Any]:
    texts: dict[int, str] = {}
    ends: dict[int, tuple[str | None, int | str | None]] = {}
    logprobs: dict[int, p.ChatLogprobs] = {}
    tokens = 0
    top_k = generation.params.logprobs
    async for d in _timed(metrics, generation):
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
    choices = []
    for i in sorted(texts):
        reason, stop_reason = ends.get(i, (None, None))
        message = p.ChatResponseMessage(content=texts[i])
        if tools.reads_calls:
            message, called = whole_message(tools, texts[i])
            reason = tool_finish_reason(tools, called, reason)
        choice = p.ChatChoice(
            index=i,
            message=message,
            logprobs=logprobs.get(i),
            finish_reason=reason,
            stop_reason=stop_reason,
        )
        choices.append(choice)
    response = p.ChatCompletionResponse(
        model=model_name, choices=choices, usage=_usage(generation, tokens)
    )
    return response.model_dump()


async def chat_chunks(
    model_name: str,
    metrics: ServingMetrics,
    body: p.ChatCompletionRequest,
    generation: Generation,
    tools: ToolPlan = NO_TOOLS,
) -> AsyncIterator[str]:
    events = _ChunkEvents(p.ChatCompletionChunk(model=model_name, choices=[]))
    started: set[int] = set()
    calls: dict[int, StreamedCalls] = {}
    tokens = 0
    top_k = generation.params.logprobs
    async for d in _timed(metrics, generation):
        tokens += len(d.token_ids)
        finish_reason = p.openai_finish_reason(d.finish_reason)
        deltas: list[dict[str, Any]] = [{"content": d.text}]
        if tools.reads_calls:
            streamed = calls.setdefault(d.index, StreamedCalls(tools))
            deltas = streamed.feed(d.text)
            if finish_reason is not None:
                deltas += streamed.finish()
                finish_reason = tool_finish_reason(tools, streamed.calls > 0, finish_reason)
            if not deltas and (finish_reason or top_k is not None or d.index not in started):
                deltas = [{}]  # a chunk is still due: the role, the logprobs or the end
        if deltas and d.index not in started:  # the role comes once, in a choice's first chunk
            started.add(d.index)
            deltas[0] = {"role": "assistant"} | deltas[0]
        for k, delta in enumerate(deltas):
            last = k == len(deltas) - 1
            reason = finish_reason if last else None
            if top_k is None:
                yield events.choice({"index": d.index, "delta": delta, "finish_reason": reason})
                continue
            choice = p.ChatChunkChoice(
                index=d.index,
                delta=p.DeltaMessage.model_validate(delta),
                logprobs=chat_logprobs(d.token_ids, d.logprobs, top_k) if last else None,
                finish_reason=reason,
            )
            yield events.choice(choice)
    if body.stream_options and body.stream_options.include_usage:
        yield events.usage(_usage(generation, tokens))
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
