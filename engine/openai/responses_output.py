"""The ``response`` object of the Responses API and its output items, whole or while streaming
(``responses_stream.py``), and the chat turn a stored answer becomes for a continuation."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from corefleet.engine.openai.responses_models import ResponsesRequest


def new_id(prefix: str) -> str:
    """``resp_<hex>``, ``msg_<hex>``, ``fc_<hex>``: OpenAI's id styles."""
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(frozen=True)
class ResponseHead:
    """What every ``response`` object of one request repeats."""

    request: ResponsesRequest
    id: str
    created_at: int
    model: str

    def response(
        self,
        output: list[dict[str, Any]],
        finish_reason: str | None,
        usage: dict[str, Any] | None,
    ) -> dict[str, Any]:
        """The ``response`` object; ``finish_reason`` None: still in progress."""
        status, incomplete, error = _status(finish_reason)
        r = self.request
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": r.parallel_tool_calls is not False,
            "previous_response_id": r.previous_response_id,
            "temperature": r.temperature,
            "top_p": r.top_p,
            "tool_choice": _tool_choice(r),
            "tools": [t.model_dump(exclude_none=True) for t in r.tools or []],
            "text": {"format": r.text.format.model_dump(by_alias=True, exclude_none=True)}
            if r.text and r.text.format
            else {"format": {"type": "text"}},
            "truncation": "disabled",
            "store": r.store is not False,
            "metadata": r.metadata or {},
            "user": r.user,
            "usage": None if usage is None else response_usage(usage),
        }


def _status(finish_reason: str | None) -> tuple[str, dict[str, str] | None, Any]:
    if finish_reason is None:
        return "in_progress", None, None
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}, None
    if finish_reason in ("abort", "error"):
        return "failed", None, {"code": "server_error", "message": f"generation {finish_reason}"}
    return "completed", None, None


def _tool_choice(request: ResponsesRequest) -> Any:
    choice = request.tool_choice
    if choice is None:
        return "auto" if request.tools else "none"
    return choice if isinstance(choice, str) else choice.model_dump()


def response_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """A chat ``usage`` in the Responses API's names."""
    details = usage.get("prompt_tokens_details") or {}
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": details.get("cached_tokens") or 0},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }


def message_item(text: str, status: str = "completed") -> dict[str, Any]:
    """An assistant ``message`` output item holding ``text``."""
    return {
        "type": "message",
        "id": new_id("msg"),
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def call_item(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """A ``function_call`` output item."""
    return {
        "type": "function_call",
        "id": new_id("fc"),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": "completed",
    }


def output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat answer's message as output items: its text, then its calls."""
    calls = message.get("tool_calls") or []
    items = [] if calls and not message.get("content") else [message_item(message["content"] or "")]
    for call in calls:
        function = call["function"]
        items.append(call_item(call["id"], function["name"], function["arguments"]))
    return items


def assistant_message(output: list[dict[str, Any]]) -> dict[str, Any]:
    """Output items as the assistant chat turn a continuation shows the model."""
    text = "".join(
        part["text"] for item in output if item["type"] == "message" for part in item["content"]
    )
    calls = [
        {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        for item in output
        if item["type"] == "function_call"
    ]
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return message
