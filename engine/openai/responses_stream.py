"""A streamed Responses API answer: OpenAI's typed server-sent events.

``response.created`` and ``response.in_progress`` first; for the text, ``output_item.added``,
``content_part.added``, an ``output_text.delta`` per piece, then ``output_text.done``,
``content_part.done`` and ``output_item.done``; for each tool call, its ``output_item.added``,
one ``function_call_arguments.delta`` (a call is sent once complete, as in chat streams: a call
cut short never reaches the client), ``function_call_arguments.done`` and ``output_item.done``;
last ``response.completed`` (or ``response.incomplete`` / ``response.failed``) with the whole
response. Every event carries ``type`` and a ``sequence_number``; no ``[DONE]`` follows, as at
OpenAI.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec

from corefleet.engine.openai import protocol as p
from corefleet.engine.openai.metrics import ServingMetrics
from corefleet.engine.openai.responses import _timed
from corefleet.engine.openai.responses_output import (
    ResponseHead,
    call_item,
    message_item,
    response_usage,
)
from corefleet.engine.openai.serving import Generation
from corefleet.engine.openai.tool_output import StreamedCalls
from corefleet.engine.openai.tool_request import ToolPlan

_JSON = msgspec.json.Encoder()


class _Events:
    """Numbers and frames the events of one stream."""

    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {_JSON.encode(event).decode()}\n\n"


class _Text:
    """The message item while its text streams."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.item = message_item("", status="in_progress")
        self.text = ""


async def stream_events(
    head: ResponseHead, metrics: ServingMetrics, generation: Generation, tools: ToolPlan
) -> AsyncIterator[tuple[str, dict[str, Any] | None]]:
    """Each event of the answer, with the final ``response`` object beside the last one."""
    event = _Events()
    yield event("response.created", response=head.response([], None, None)), None
    yield event("response.in_progress", response=head.response([], None, None)), None
    output: list[dict[str, Any]] = []
    text: _Text | None = None
    calls = StreamedCalls(tools) if tools.reads_calls else None
    tokens = 0
    reason: str | None = None
    async for d in _timed(metrics, generation):
        tokens += len(d.token_ids)
        reason = p.openai_finish_reason(d.finish_reason)
        pieces: list[dict[str, Any]] = (
            [{"content": d.text}] if calls is None else calls.feed(d.text)
        )
        if calls is not None and reason is not None:
            pieces += calls.finish(reason)
        for piece in pieces:
            if piece.get("content"):
                if text is None:
                    text = _Text(len(output))
                    output.append(text.item)
                    for e in _text_opens(event, text):
                        yield e, None
                text.text += piece["content"]
                yield _text_delta(event, text, piece["content"]), None
            for call in piece.get("tool_calls") or []:
                function = call["function"]
                item = call_item(call["id"], function["name"], function["arguments"])
                output.append(item)
                for e in _call_events(event, len(output) - 1, item):
                    yield e, None
    if text is not None:
        for e in _text_closes(event, text):
            yield e, None
    elif not output:  # an empty answer is still a message, as in a whole response
        text = _Text(0)
        output.append(text.item)
        for e in (*_text_opens(event, text), *_text_closes(event, text)):
            yield e, None
    usage = p.UsageInfo(prompt_tokens=generation.num_prompt_tokens, completion_tokens=tokens)
    final = head.response(output, reason or "stop", None)
    final["usage"] = response_usage(usage.model_dump())
    kind = {"completed": "response.completed", "incomplete": "response.incomplete"}
    yield event(kind.get(final["status"], "response.failed"), response=final), final


def _text_opens(event: _Events, text: _Text) -> list[str]:
    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    return [
        event("response.output_item.added", output_index=text.index, item=text.item),
        event(
            "response.content_part.added",
            item_id=text.item["id"],
            output_index=text.index,
            content_index=0,
            part=part,
        ),
    ]


def _text_delta(event: _Events, text: _Text, delta: str) -> str:
    return event(
        "response.output_text.delta",
        item_id=text.item["id"],
        output_index=text.index,
        content_index=0,
        delta=delta,
        logprobs=[],
    )


def _text_closes(event: _Events, text: _Text) -> list[str]:
    part = {"type": "output_text", "text": text.text, "annotations": [], "logprobs": []}
    text.item["content"] = [part]
    text.item["status"] = "completed"
    where = {"item_id": text.item["id"], "output_index": text.index, "content_index": 0}
    return [
        event("response.output_text.done", **where, text=text.text, logprobs=[]),
        event("response.content_part.done", **where, part=part),
        event("response.output_item.done", output_index=text.index, item=text.item),
    ]


def _call_events(event: _Events, index: int, item: dict[str, Any]) -> list[str]:
    opened = item | {"arguments": "", "status": "in_progress"}
    where = {"item_id": item["id"], "output_index": index}
    return [
        event("response.output_item.added", output_index=index, item=opened),
        event("response.function_call_arguments.delta", **where, delta=item["arguments"]),
        event(
            "response.function_call_arguments.done",
            **where,
            name=item["name"],
            arguments=item["arguments"],
        ),
        event("response.output_item.done", output_index=index, item=item),
    ]
