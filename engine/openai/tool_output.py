"""Tool calling on the answer side: one choice's generated text as content and ``tool_calls``,
whole (a chat completion) or as stream deltas (chunks), shaped as OpenAI's.

``auto`` reads calls with the server's ``--tool-call-parser``, ``required`` reads the JSON
array its constraint produced, and a named function's text is that function's arguments.
``finish_reason`` becomes ``tool_calls`` when the model called a tool under ``auto`` or
``required`` and stopped by itself; a forced function ends with ``stop``, as at OpenAI.

A call is sent only whole: streamed, each call comes in one delta once it is complete (a named
function's when its arguments end, which is when the choice ends), so a call cut short by
``max_tokens`` never reaches the client, in a stream or not. Such a choice ends with
``finish_reason: "length"``, the calls it completed before the cut, and neither a partial call
nor its text in ``content`` (``tool_calls`` null when it completed none), as vLLM and OpenAI
answer.
"""

from __future__ import annotations

from typing import Any

from corefleet.engine.openai.response_models import (
    ChatResponseMessage,
    ChatToolCall,
    FunctionCall,
    tool_call_id,
)
from corefleet.engine.openai.tool_parsers import ToolCall, extract_all, make_extractor
from corefleet.engine.openai.tool_request import ToolPlan


def _extractor_mode(plan: ToolPlan) -> str | None:
    """The parser mode of ``plan``'s answers (None: named, whose text is the arguments)."""
    if plan.mode == "auto":
        return plan.parser
    return "required" if plan.mode == "required" else None


def whole_message(
    plan: ToolPlan, text: str, reason: str | None = None
) -> tuple[ChatResponseMessage, bool]:
    """The message of a choice under ``plan`` (which reads calls) that ended with ``reason``,
    and whether it holds any tool call."""
    mode = _extractor_mode(plan)
    cut = reason == "length"
    if mode is None:
        calls = [] if cut else [ToolCall(plan.function or "", text)]
        content = None
    else:
        content, calls = extract_all(mode, text, cut)
        calls = calls if plan.parallel else calls[:1]
    tool_calls = [
        ChatToolCall(function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls
    ]
    return ChatResponseMessage(content=content, tool_calls=tool_calls or None), bool(calls)


def tool_finish_reason(plan: ToolPlan, called: bool, reason: str | None) -> str | None:
    """OpenAI's ``finish_reason`` of a choice that ended with ``reason``."""
    if called and reason == "stop" and plan.mode in ("auto", "required"):
        return "tool_calls"
    return reason


class StreamedCalls:
    """One streamed choice: its text deltas in, OpenAI ``delta`` objects out (without
    ``role``), each holding ``content`` or one ``tool_calls`` piece."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        mode = _extractor_mode(plan)
        self._extractor = None if mode is None else make_extractor(mode)
        self.calls = 0  # calls sent so far
        self._arguments: list[str] = []  # named: the arguments so far, sent when they end

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas that ``text``, the choice's next piece of output, makes certain."""
        if self._extractor is None:
            self._arguments.append(text)
            return []
        return [d for piece in self._extractor.feed(text) for d in self._delta(piece)]

    def finish(self, reason: str | None = None) -> list[dict[str, Any]]:
        """The deltas held back until the choice ended with ``reason``."""
        cut = reason == "length"
        if self._extractor is None:
            arguments, self._arguments = "".join(self._arguments), []
            return [] if cut else self._delta(ToolCall(self.plan.function or "", arguments))
        return [d for piece in self._extractor.finish(cut) for d in self._delta(piece)]

    def _delta(self, piece: str | ToolCall) -> list[dict[str, Any]]:
        if isinstance(piece, str):
            return [{"content": piece}] if piece else []
        if self.calls and not self.plan.parallel:
            return []  # parallel_tool_calls false: the first call only
        self.calls += 1
        return [_call_delta(self.calls - 1, piece.name, piece.arguments)]


def _call_delta(index: int, name: str, arguments: str) -> dict[str, Any]:
    """The first delta of a call, as OpenAI streams it: id, type and name with it."""
    function = {"name": name, "arguments": arguments}
    call = {"index": index, "id": tool_call_id(), "type": "function", "function": function}
    return {"tool_calls": [call]}
