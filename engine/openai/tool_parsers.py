"""Tool calls read out of a chat model's generated text, whole or while it streams.

A model calls a tool by writing the call into its text, in a format it was trained on; the
answer's ``tool_calls`` are read back from it in one of three ways (``make_extractor``'s modes):

- ``hermes`` (vLLM's parser of that name: Qwen2.5, Hermes, SmolLM2): ``<tool_call>`` JSON
  ``</tool_call>`` blocks amid the content. A block holds ``{"name": ..., "arguments": {...}}``,
  or a list of such objects (SmolLM2). A block that is not valid JSON of that shape stays in the
  content, tags included; a block left open at the end is read as if it were closed.
- ``llama3_json`` (vLLM's parser of that name: Llama 3.1/3.2): the whole text, after an
  optional ``<|python_tag|>``, is ``{"name": ..., "parameters": {...}}`` objects separated by
  ``;``. Either all of it is calls or all of it is content.
- ``required`` (``tool_choice="required"``, whose output a JSON schema constrained): the text is
  a JSON array of ``{"name": ..., "arguments": {...}}`` objects; each call is released as soon as
  its element closes. From the first element that is not a valid call (or never closes, the
  output being cut by ``max_tokens``), the rest of the raw text is content; calls already
  released stay calls. The whole-text reading is the same, so the two always agree.

A text cut short by ``max_tokens`` (``finish(cut=True)``) ends with no partial call: what was
still held as the beginning of a call that never completed is dropped, neither a call nor
content (as vLLM and OpenAI answer ``finish_reason: "length"``); calls completed before the cut
stay calls.

Every format accepts ``arguments`` and ``parameters`` alike, arguments given as a JSON string
holding an object, and missing arguments (``{}``). ``ToolCall.arguments`` is the object written
back with ``json.dumps(..., ensure_ascii=False)``.

Streaming: an extractor is fed a choice's text deltas and returns only pieces that are final,
holding back what the next delta could still turn into a call. The result never depends on how
the text was split into deltas, and text in which no call is found comes back unchanged. All of
it is linear in the text's length: a client chooses ``max_tokens``.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

PARSER_NAMES: tuple[str, ...] = ("hermes", "llama3_json")


@dataclass(frozen=True)
class ToolCall:
    """One function call the model made."""

    name: str
    arguments: str  # JSON text of an object, as OpenAI's function.arguments


Piece = str | ToolCall  # a piece of output: content text, or one complete tool call


class ToolCallExtractor(ABC):
    """Reads the calls out of one choice's text, delta by delta: one text per extractor, so
    nothing is fed after :meth:`finish`."""

    @abstractmethod
    def feed(self, text: str) -> list[Piece]:
        """The pieces that the next text delta makes certain (never retracted later)."""

    @abstractmethod
    def finish(self, cut: bool = False) -> list[Piece]:
        """Generation ended: the pieces held back until now. ``cut``: it ended at
        ``max_tokens``, so a call still incomplete is dropped rather than read as content."""


def make_extractor(mode: str) -> ToolCallExtractor:
    """A fresh extractor: ``mode`` is one of :data:`PARSER_NAMES` (``tool_choice="auto"``) or
    ``"required"``.

    Raises:
        ValueError: another mode.
    """
    extractors: dict[str, type[ToolCallExtractor]] = {
        "hermes": _Hermes,
        "llama3_json": _Llama3Json,
        "required": _RequiredArray,
    }
    if mode not in extractors:
        raise ValueError(f"unknown tool call parser {mode!r}, expected one of {sorted(extractors)}")
    return extractors[mode]()


def extract_all(mode: str, text: str, cut: bool = False) -> tuple[str | None, list[ToolCall]]:
    """The whole ``text`` at once, read as the extractor of ``mode`` reads it streamed:
    ``(content, calls)``. ``content`` is None when there are calls and it is only whitespace,
    or when the text was ``cut`` by ``max_tokens`` and nothing of it is content.

    Raises:
        ValueError: an unknown mode.
    """
    extractor = make_extractor(mode)
    pieces = extractor.feed(text) + extractor.finish(cut)
    content = "".join(piece for piece in pieces if isinstance(piece, str))
    calls = [piece for piece in pieces if isinstance(piece, ToolCall)]
    if (calls and not content.strip()) or (cut and not content):
        return None, calls
    return content, calls


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # NaN and Infinity: json.dumps would write them back


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)
_JSON_SPACE = re.compile(r"[ \t\n\r]*")


def _loads(text: str) -> Any:
    """``text`` as JSON; None when it is not (JSON ``null`` is never a valid call either)."""
    try:
        return _DECODER.decode(text)
    except (ValueError, RecursionError):  # the decoder recurses once per nesting level
        return None


def _call(obj: Any) -> ToolCall | None:
    """The call that one decoded JSON value describes; None when it has not the shape of one."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    arguments = obj["arguments"] if "arguments" in obj else obj.get("parameters", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        arguments = _loads(arguments)
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    try:
        return ToolCall(name, json.dumps(arguments, ensure_ascii=False))
    except RecursionError:
        return None


def _calls(obj: Any) -> list[ToolCall] | None:
    """The calls of an object or a non-empty list of objects; None unless every one is valid."""
    items = obj if isinstance(obj, list) else [obj]
    calls = [_call(item) for item in items]
    if not calls or None in calls:
        return None
    return [call for call in calls if call is not None]


def _skip_space(text: str, pos: int) -> int:
    """Where the JSON whitespace at ``pos`` in ``text`` ends."""
    match = _JSON_SPACE.match(text, pos)
    return match.end() if match else pos


def _prefix_at_end(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a proper prefix of ``tag``."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


class _Hermes(ToolCallExtractor):
    """``<tool_call>`` blocks amid content (the module docstring has the format)."""

    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"

    def __init__(self) -> None:
        self._held = ""  # outside a block: an end of the text that may begin OPEN
        self._block: list[str] | None = None  # inside a block: its text since OPEN
        self._tail = ""  # inside: the block's last characters, for a CLOSE split over deltas

    def feed(self, text: str) -> list[Piece]:
        """See :meth:`ToolCallExtractor.feed`."""
        out: list[Piece] = []
        while text:
            text = self._outside(text, out) if self._block is None else self._inside(text, out)
        return out

    def finish(self, cut: bool = False) -> list[Piece]:
        """See :meth:`ToolCallExtractor.finish`; a block still open is read as if closed (when
        ``cut``, one that holds no valid call is dropped, as is a held start of ``OPEN``)."""
        out: list[Piece] = []
        if self._block is not None:
            inner = "".join(self._block)
            pieces = self._read_block(inner, self.OPEN + inner)
            out.extend(p for p in pieces if not (cut and isinstance(p, str)))
        elif self._held and not cut:
            out.append(self._held)
        self._held, self._block = "", None
        return out

    def _outside(self, text: str, out: list[Piece]) -> str:
        """Release the content before a block (or all that cannot begin one); what follows."""
        text = self._held + text  # _held is shorter than OPEN: this stays linear
        start = text.find(self.OPEN)
        if start < 0:
            start = len(text) - _prefix_at_end(text, self.OPEN)
            self._held, rest = text[start:], ""
        else:
            self._held, self._block, self._tail = "", [], ""
            rest = text[start + len(self.OPEN) :]
        if start:
            out.append(text[:start])
        return rest

    def _inside(self, text: str, out: list[Piece]) -> str:
        """Add to the open block; at its CLOSE, release its call(s); the text after the block."""
        assert self._block is not None
        searched = self._tail + text  # _tail is shorter than CLOSE: this stays linear
        found = searched.find(self.CLOSE)
        if found < 0:
            self._block.append(text)
            self._tail = searched[-len(self.CLOSE) + 1 :]
            return ""
        whole = "".join(self._block) + text  # joined once per block
        end = len(whole) - len(text) - len(self._tail) + found  # where CLOSE starts
        out.extend(self._read_block(whole[:end], self.OPEN + whole[:end] + self.CLOSE))
        self._block = None
        return whole[end + len(self.CLOSE) :]

    @staticmethod
    def _read_block(inner: str, raw: str) -> list[Piece]:
        """The call(s) of a block's ``inner`` text, or the block's ``raw`` text as content."""
        calls = _calls(_loads(inner.strip()))
        return [raw] if calls is None else list(calls)


class _Llama3Json(ToolCallExtractor):
    """Llama 3's JSON calls: the whole text or nothing (the module docstring has the format)."""

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        self._held: list[str] = []  # the whole text, until it is known to be content
        self._head = ""  # its first non-whitespace characters, as many as TAG has
        self._content = False  # decided: plain content, released as it comes

    def feed(self, text: str) -> list[Piece]:
        """See :meth:`ToolCallExtractor.feed`: content flows once the text's start rules out a
        call; a text that starts like one is held until :meth:`finish`."""
        if self._content:
            return [text] if text else []
        self._held.append(text)
        if len(self._head) < len(self.TAG):
            # Only the first characters decide, so a long text is never looked at twice.
            self._head += (text if self._head else text.lstrip())[: len(self.TAG) - len(self._head)]
            head = self._head
            if head and not head.startswith(("{", self.TAG)) and not self.TAG.startswith(head):
                self._content = True
                held, self._held = "".join(self._held), []
                return [held] if held else []
        return []

    def finish(self, cut: bool = False) -> list[Piece]:
        """See :meth:`ToolCallExtractor.finish`: the held text's calls, or the text itself
        (nothing when ``cut``: the held text began like a call)."""
        text, self._held = "".join(self._held), []
        calls = self._parse(text)
        if calls is not None:
            return list(calls)
        return [text] if text and not cut else []

    def _parse(self, text: str) -> list[ToolCall] | None:
        """The calls of ``{...}; {...}`` (a trailing ``;`` allowed); None unless all are."""
        text = text.strip()
        if text.startswith(self.TAG):
            text = text[len(self.TAG) :].lstrip()
        if not text.startswith("{"):
            return None
        calls: list[ToolCall] = []
        pos = 0
        while pos < len(text):
            try:  # raw_decode: a ';' inside a string is not a separator
                obj, pos = _DECODER.raw_decode(text, pos)
            except (ValueError, RecursionError):
                return None
            call = _call(obj)
            if call is None:
                return None
            calls.append(call)
            pos = _skip_space(text, pos)
            if pos < len(text) and text[pos] != ";":
                return None
            pos = _skip_space(text, pos + 1)
        return calls


class _RequiredArray(ToolCallExtractor):
    """The JSON array of calls that ``tool_choice="required"`` constrains the output to; each
    call released as its element closes (the module docstring has what is content)."""

    START, ELEMENT, AFTER, DONE, FAILED = range(5)  # states between elements (_depth is 0)
    _IN_STRING = re.compile(r'["\\]')  # inside a string only these change the state
    _STRUCTURE = re.compile(r'["{}\[\]]')  # outside strings, only these

    def __init__(self) -> None:
        self._state = self.START  # expecting '[', or an element, or ',' / ']', ...
        self._pending: list[str] = []  # the raw text since the last call released
        self._pending_len = 0
        self._start = 0  # where the current element starts in the pending text
        self._depth = 0  # brackets open in the current element
        self._string = False  # inside a JSON string
        self._escape = False  # right after a backslash in that string

    def feed(self, text: str) -> list[Piece]:
        """See :meth:`ToolCallExtractor.feed`: a call for each element that closes."""
        if self._state == self.FAILED:
            return [text] if text else []
        out: list[Piece] = []
        kept = 0  # text[:kept] went into a call released already: not pending
        pos = 0
        while pos < len(text):
            if self._depth:
                pos = self._scan_element(text, pos)
                if self._depth:
                    continue
                whole = "".join(self._pending) + text[kept:pos]
                call = _call(_loads(whole[self._start :]))
                if call is None:
                    return self._fail(out, whole + text[pos:])
                out.append(call)
                self._pending, self._pending_len, kept = [], 0, pos
                self._state = self.AFTER
                continue
            pos = _skip_space(text, pos)
            if pos == len(text):
                break
            char = text[pos]
            if self._state == self.START and char == "[":
                self._state = self.ELEMENT
            elif self._state == self.ELEMENT and char == "{":
                self._start = self._pending_len + pos - kept
                self._depth = 1
            elif self._state == self.AFTER and char in ",]":
                self._state = self.ELEMENT if char == "," else self.DONE
            else:  # not an array of objects (an empty array has no element either)
                return self._fail(out, "".join(self._pending) + text[kept:])
            pos += 1
        self._pending.append(text[kept:])
        self._pending_len += len(text) - kept
        return out

    def finish(self, cut: bool = False) -> list[Piece]:
        """See :meth:`ToolCallExtractor.finish`: unless the array closed, the raw text after
        the last call released is content (dropped when ``cut``: a call cut short)."""
        rest = "".join(self._pending)
        complete = self._state in (self.DONE, self.FAILED)
        self._pending, self._pending_len = [], 0
        return [rest] if rest and not complete and not cut else []

    def _scan_element(self, text: str, pos: int) -> int:
        """Follow strings and brackets from ``pos`` until the element closes or ``text`` ends;
        where it stopped. Whole runs of plain characters are skipped by one regex search."""
        while pos < len(text) and self._depth:
            if self._escape:
                self._escape, pos = False, pos + 1
                continue
            pattern = self._IN_STRING if self._string else self._STRUCTURE
            found = pattern.search(text, pos)
            if found is None:
                return len(text)
            char, pos = found.group(), found.end()
            if char == "\\":
                self._escape = True
            elif char == '"':
                self._string = not self._string
            else:
                self._depth += 1 if char in "{[" else -1
        return pos

    def _fail(self, out: list[Piece], rest: str) -> list[Piece]:
        """No valid call from here: ``rest`` (all not yet released) and all after is content."""
        self._state = self.FAILED
        self._pending, self._pending_len = [], 0
        if rest:
            out.append(rest)
        return out
