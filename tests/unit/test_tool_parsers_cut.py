"""Tool-call readers on a text cut short by ``max_tokens`` (``finish(cut=True)``): no partial
call comes back, as a call or as content; calls completed before the cut stay calls."""

from __future__ import annotations

import random

import pytest

from corefleet.engine.openai.tool_parsers import ToolCall, extract_all, make_extractor
from tests.unit.test_tool_parsers import QWEN_BLOCK, WEATHER, _random_split


@pytest.mark.parametrize(
    ("mode", "text", "expected"),
    [
        # An unfinished call is dropped: neither a call nor content (finish_reason "length").
        ("required", '[{"name": "get_weather", "argu', (None, [])),
        ("required", "[", (None, [])),
        (
            "required",
            '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"n',
            (None, [WEATHER]),
        ),
        ("hermes", 'Sure. <tool_call>{"name": "get_weather", "arguments": {"ci', ("Sure. ", [])),
        ("hermes", "Sure. <tool_", ("Sure. ", [])),
        ("hermes", QWEN_BLOCK + "<tool_call>{", (None, [WEATHER])),
        # A block whose JSON is whole is a whole call, its closing tag or not.
        ("hermes", QWEN_BLOCK[: -len("</tool_call>")], (None, [WEATHER])),
        ("hermes", "Plain text cut mid-sente", ("Plain text cut mid-sente", [])),
        ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"ci', (None, [])),
        ("llama3_json", "Plain text cut", ("Plain text cut", [])),
    ],
)
def test_a_text_cut_by_max_tokens_holds_no_partial_call(
    mode: str, text: str, expected: tuple[str | None, list[ToolCall]]
) -> None:
    assert extract_all(mode, text, cut=True) == expected
    rng = random.Random(7)
    for deltas in ([text], list(text), *(_random_split(text, rng) for _ in range(10))):
        extractor = make_extractor(mode)
        pieces = [p for d in deltas for p in extractor.feed(d)] + extractor.finish(cut=True)
        content = "".join(p for p in pieces if isinstance(p, str))
        assert [p for p in pieces if isinstance(p, ToolCall)] == expected[1]
        assert content == (expected[0] or "")
