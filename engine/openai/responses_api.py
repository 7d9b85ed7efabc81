"""The Responses API (``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``), which
the OpenAI Agents SDK and newer clients use by default.

A request is served as the chat completion it amounts to (``responses_models.py``): the same
admission, template, tools, constraints and limits; the answer is reshaped into a ``response``
object, whose ``output`` holds a ``message`` item with the text and a ``function_call`` item per
tool call. ``status`` is ``completed``, or ``incomplete`` with ``incomplete_details.reason``
``max_output_tokens`` when the answer was cut short. Streamed, it is OpenAI's sequence of typed
events (``responses_stream.py``).

``previous_response_id`` continues a stored response's conversation. Responses are stored
(``store``, default true) in this process's memory, the newest :data:`MAX_STORED_RESPONSES`
of them: a coordinator restart, another coordinator replica or an evicted id answer 404.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec

from corefleet.engine.openai import protocol as p
from corefleet.engine.openai.errors import RequestError, parse_request
from corefleet.engine.openai.extra_fields import check_extra_fields
from corefleet.engine.openai.generation_api import GenerationApi
from corefleet.engine.openai.replies import Reply, StreamReply, error_reply, json_reply
from corefleet.engine.openai.responses import chat_response
from corefleet.engine.openai.responses_models import ResponsesRequest
from corefleet.engine.openai.responses_output import (
    ResponseHead,
    assistant_message,
    new_id,
    output_items,
)
from corefleet.engine.openai.responses_stream import stream_events

# Stored responses kept per coordinator process; the oldest go first. Each holds its
# conversation, bounded by the request limits (messages, body size).
MAX_STORED_RESPONSES = 1024

# Chat field -> the Responses field a client set, for error messages.
_FIELD_NAMES = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
}


@dataclass(frozen=True)
class StoredResponse:
    """A response as returned, and the conversation a continuation starts from."""

    response: dict[str, Any]
    history: list[dict[str, Any]]  # chat messages, its answer last, without instructions


class ResponsesApi:
    """The Responses endpoints over a :class:`GenerationApi`."""

    def __init__(self, generation: GenerationApi) -> None:
        self.generation = generation
        self.state = generation.state
        self.stored: OrderedDict[str, StoredResponse] = OrderedDict()
        self.endpoints = {"/v1/responses": self.create}

    async def create(self, raw: bytes, key_id: str | None) -> Reply:
        """``POST /v1/responses``."""
        try:
            request = parse_request(ResponsesRequest, raw)
            check_extra_fields(request.model_extra, "responses")
            history = self._history(request.previous_response_id)
            body = _chat_body(request, history)
            prompt, tools = self.generation.chat_prompt(body)
            ticket, generation = await self.generation.start(key_id, body, [prompt], tools)
        except RequestError as err:
            return error_reply(_renamed(err))
        head = ResponseHead(request, new_id("resp"), int(time.time()), self.state.model_name)
        conversation = history + request.conversation()
        if request.stream:
            metrics = self.state.metrics

            async def events() -> AsyncIterator[str]:
                try:
                    async for event, final in stream_events(head, metrics, generation, tools):
                        if final is not None:
                            self._store(request, final, conversation)
                        yield event
                finally:
                    ticket.release()

            return StreamReply(events())
        try:
            chat = await chat_response(
                self.state.model_name, self.state.metrics, body, generation, tools
            )
        finally:
            ticket.release()
        choice = chat["choices"][0]
        response = head.response(
            output_items(choice["message"]), choice["finish_reason"], chat["usage"]
        )
        self._store(request, response, conversation)
        return json_reply(response)

    def get(self, response_id: str) -> dict[str, Any]:
        """``GET /v1/responses/{id}`` (404 if not stored here)."""
        return self._find(response_id).response

    def delete(self, response_id: str) -> dict[str, Any]:
        """``DELETE /v1/responses/{id}``."""
        self._find(response_id)
        del self.stored[response_id]
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    def _history(self, previous: str | None) -> list[dict[str, Any]]:
        if previous is None:
            return []
        return list(self._find(previous, "previous_response_id").history)

    def _find(self, response_id: str, param: str | None = None) -> StoredResponse:
        stored = self.stored.get(response_id)
        if stored is None:
            raise RequestError(
                f"no response with id {response_id!r} is stored by this server (responses are "
                f"kept in the answering coordinator's memory, the newest "
                f"{MAX_STORED_RESPONSES}, and only with store=true)",
                status=404,
                param=param,
                code="response_not_found",
            )
        return stored

    def _store(
        self, request: ResponsesRequest, response: dict[str, Any], history: list[dict[str, Any]]
    ) -> None:
        if not request.store:
            return
        answer = assistant_message(response["output"])
        self.stored[response["id"]] = StoredResponse(response, [*history, answer])
        while len(self.stored) > MAX_STORED_RESPONSES:
            self.stored.popitem(last=False)


def _chat_body(request: ResponsesRequest, history: list[dict[str, Any]]) -> p.ChatCompletionRequest:
    """The chat request ``request`` amounts to, validated as any chat request is."""
    raw = msgspec.json.encode(request.chat_request(history))
    return parse_request(p.ChatCompletionRequest, raw)


def _renamed(err: RequestError) -> RequestError:
    """``err`` naming the Responses field where it names the chat field made from it."""
    if err.param is None:
        return err
    head, dot, rest = err.param.partition(".")
    if head not in _FIELD_NAMES:
        return err
    err.param = _FIELD_NAMES[head] + dot + rest
    return err
