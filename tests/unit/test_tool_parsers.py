"""Tool calls read out of generated text: whole, and streamed in any split into deltas."""

from __future__ import annotations

import json
import random

import pytest

from corefleet.engine.openai.tool_parsers import (
    PARSER_NAMES,
    Piece,
    ToolCall,
    extract_all,
    make_extractor,
)

MODES = ("hermes", "llama3_json", "required")
WEATHER = ToolCall("get_weather", '{"city": "Paris"}')
QWEN_BLOCK = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TIME_BLOCK = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
TIME = ToolCall("get_time", '{"zone": "CET"}')
F = ToolCall("f", "{}")


def _merge(pieces: list[Piece]) -> list[Piece]:
    """Adjacent content pieces joined, as a caller sees them; no piece may be empty."""
    merged: list[Piece] = []
    run: list[str] = []  # joined once per run: a long stream of one-character pieces is quick
    for piece in pieces:
        assert piece != "", "an extractor returned an empty content piece"
        if isinstance(piece, str):
            run.append(piece)
            continue
        if run:
            merged.append("".join(run))
            run = []
        merged.append(piece)
    if run:
        merged.append("".join(run))
    return merged


def _stream(mode: str, deltas: list[str]) -> list[Piece]:
    extractor = make_extractor(mode)
    pieces: list[Piece] = []
    for delta in deltas:
        pieces += extractor.feed(delta)
    return _merge(pieces + extractor.finish())


def _whole(mode: str, text: str) -> list[Piece]:
    return _stream(mode, [text])


def _random_split(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 6))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def _assert_split_invariant(mode: str, text: str, rng: random.Random) -> None:
    """Every way of cutting ``text`` into deltas gives what feeding it whole gives."""
    expected = _whole(mode, text)
    assert _stream(mode, list(text)) == expected
    for cut in range(len(text) + 1):
        assert _stream(mode, [text[:cut], "", text[cut:]]) == expected, cut
    if len(text) > 1:
        for _ in range(20):
            assert _stream(mode, _random_split(text, rng)) == expected
    if not any(isinstance(piece, ToolCall) for piece in expected):
        assert "".join(piece for piece in expected if isinstance(piece, str)) == text


# --- hermes -----------------------------------------------------------------------------------


def test_hermes_qwen_block_is_one_call() -> None:
    assert extract_all("hermes", QWEN_BLOCK) == (None, [WEATHER])
    assert extract_all("hermes", QWEN_BLOCK + "\n") == (None, [WEATHER])


def test_hermes_content_before_and_between_blocks() -> None:
    text = f"Let me check both.\n{QWEN_BLOCK}\n{TIME_BLOCK}"
    assert _whole("hermes", text) == ["Let me check both.\n", WEATHER, "\n", TIME]
    assert extract_all("hermes", text) == ("Let me check both.\n\n", [WEATHER, TIME])


def test_hermes_whitespace_between_calls_is_content_pieces() -> None:
    text = f"{QWEN_BLOCK}\n{TIME_BLOCK}\n"
    assert _whole("hermes", text) == [WEATHER, "\n", TIME, "\n"]
    assert extract_all("hermes", text) == (None, [WEATHER, TIME])


def test_hermes_smollm2_list_form() -> None:
    text = (
        '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {"zone": "CET"}}]</tool_call>'
    )
    assert extract_all("hermes", text) == (None, [WEATHER, TIME])


def test_hermes_argument_spellings() -> None:
    parameters = '<tool_call>{"name": "f", "parameters": {"a": 1}}</tool_call>'
    as_string = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    missing = '<tool_call>{"name": "f"}</tool_call>'
    assert extract_all("hermes", parameters) == (None, [ToolCall("f", '{"a": 1}')])
    assert extract_all("hermes", as_string) == (None, [ToolCall("f", '{"a": 1}')])
    assert extract_all("hermes", missing) == (None, [F])
    both = '<tool_call>{"name": "f", "arguments": {"a": 1}, "parameters": {"b": 2}}</tool_call>'
    assert extract_all("hermes", both) == (None, [ToolCall("f", '{"a": 1}')])


@pytest.mark.parametrize(
    "inner",
    [
        '{"name": "get_weather", "arguments": {"city": "Paris"}',  # unbalanced
        "not json at all",
        '{"arguments": {}}',  # no name
        '{"name": "", "arguments": {}}',
        '{"name": 3, "arguments": {}}',
        '{"name": "f", "arguments": [1]}',
        '{"name": "f", "arguments": "[1]"}',  # a string, but not of an object
        '{"name": "f", "arguments": null}',
        '{"name": "f", "arguments": {"x": NaN}}',  # not JSON: json.dumps would write it back
        "[]",
        '[{"name": "f", "arguments": {}}, 7]',  # a list is all calls or none
        "",
    ],
)
def test_hermes_invalid_block_stays_content_exactly(inner: str) -> None:
    text = f"Sure.\n<tool_call>\n{inner}\n</tool_call> done"
    assert _whole("hermes", text) == [text]
    assert extract_all("hermes", text) == (text, [])


def test_hermes_invalid_block_then_valid_block() -> None:
    text = f"<tool_call>oops</tool_call>{QWEN_BLOCK}"
    assert _whole("hermes", text) == ["<tool_call>oops</tool_call>", WEATHER]


def test_hermes_unclosed_block_is_read_at_finish() -> None:
    extractor = make_extractor("hermes")
    assert extractor.feed('ok <tool_call>\n{"name": "get_weather", ') == ["ok "]
    assert extractor.feed('"arguments": {"city": "Paris"}}\n') == []
    assert extractor.finish() == [WEATHER]


def test_hermes_unclosed_invalid_block_is_content() -> None:
    text = 'ok <tool_call>\n{"name": "get_weather", "argu'
    assert _whole("hermes", text) == [text]


def test_hermes_call_is_released_at_its_closing_tag() -> None:
    extractor = make_extractor("hermes")
    assert extractor.feed(QWEN_BLOCK.removesuffix("</tool_call>")) == []
    assert extractor.feed("</tool_") == []
    assert extractor.feed("call>\nBye") == [WEATHER, "\nBye"]
    assert extractor.finish() == []


def test_hermes_holds_back_only_a_possible_tag_start() -> None:
    extractor = make_extractor("hermes")
    assert extractor.feed("abc<tool") == ["abc"]
    assert extractor.feed("box") == ["<toolbox"]
    assert extractor.feed("a < b") == ["a < b"]
    assert extractor.feed("x <") == ["x "]
    assert extractor.feed("") == []
    assert extractor.feed("3") == ["<3"]
    assert extractor.feed("<tool_call") == []
    assert extractor.finish() == ["<tool_call"]


def test_hermes_unicode_arguments_are_kept() -> None:
    text = '<tool_call>{"name": "translate", "arguments": {"text": "Grüße, 世界 🌍"}}</tool_call>'
    call = ToolCall("translate", '{"text": "Grüße, 世界 🌍"}')
    assert extract_all("hermes", text) == (None, [call])
    escaped = '<tool_call>{"name": "translate", "arguments": {"text": "\\u4e16"}}</tool_call>'
    assert extract_all("hermes", escaped) == (None, [ToolCall("translate", '{"text": "世"}')])


# --- llama3_json ------------------------------------------------------------------------------


def test_llama3_python_tag_with_two_calls() -> None:
    text = (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_time", "parameters": {"zone": "CET"}}'
    )
    assert extract_all("llama3_json", text) == (None, [WEATHER, TIME])


def test_llama3_plain_json_call() -> None:
    text = '\n {"name": "get_weather", "arguments": {"city": "Paris"}};\n'
    assert extract_all("llama3_json", text) == (None, [WEATHER])


def test_llama3_semicolon_inside_a_string_is_not_a_separator() -> None:
    text = '{"name": "sql", "parameters": {"q": "SELECT 1; SELECT 2"}}'
    call = ToolCall("sql", '{"q": "SELECT 1; SELECT 2"}')
    assert extract_all("llama3_json", text) == (None, [call])


def test_llama3_plain_text_is_released_as_it_comes() -> None:
    extractor = make_extractor("llama3_json")
    assert extractor.feed("  \n") == []
    assert extractor.feed("The weather") == ["  \nThe weather"]
    assert extractor.feed(" is {sunny}.") == [" is {sunny}."]
    assert extractor.finish() == []


def test_llama3_partial_python_tag_is_held() -> None:
    extractor = make_extractor("llama3_json")
    assert extractor.feed("<|py") == []
    assert extractor.feed("thon") == []
    assert extractor.feed("ic") == ["<|pythonic"]
    extractor = make_extractor("llama3_json")
    assert extractor.feed("\n<|python_tag") == []
    assert extractor.feed(" |>") == ["\n<|python_tag |>"]


def test_llama3_call_is_held_until_finish() -> None:
    extractor = make_extractor("llama3_json")
    assert extractor.feed('{"name": "get_weather", "parameters": {"city": "Paris"}}') == []
    assert extractor.finish() == [WEATHER]


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; oops',
        '{"name": "get_weather", "parameters": {"city": "Paris"}} {"name": "g"}',
        '{"name": "get_weather", "parameters": {}}, {"name": "get_time", "parameters": {}}',
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"parameters": {}}',
        '<|python_tag|>print("hello")',
        "<|python_tag|>",
        '{"name": "get_weather", "parameters": {"city": "Par',
        "{",
        "<|pyth",
        "   ",
        "",
    ],
)
def test_llama3_anything_not_all_calls_is_content_exactly(text: str) -> None:
    assert extract_all("llama3_json", text) == (text, [])


# --- required ---------------------------------------------------------------------------------


REQUIRED = (
    '[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
    '{"name": "get_time", "arguments": {"zone": "CET"}}]'
)


def test_required_array_is_calls() -> None:
    assert extract_all("required", REQUIRED) == (None, [WEATHER, TIME])
    spaced = "\n [\n  " + REQUIRED[1:-1].replace(", ", " ,\n  ") + "\n ]\n"
    assert _whole("required", spaced) == [WEATHER, TIME]


def test_required_releases_each_call_as_its_element_closes() -> None:
    extractor = make_extractor("required")
    released: list[tuple[int, Piece]] = []
    for index, char in enumerate(REQUIRED):
        released += [(index, piece) for piece in extractor.feed(char)]
    first_end = REQUIRED.index("}}") + 1
    assert released == [(first_end, WEATHER), (len(REQUIRED) - 2, TIME)]
    assert extractor.finish() == []


def test_required_first_call_comes_before_the_array_closes() -> None:
    extractor = make_extractor("required")
    assert extractor.feed('[{"name": "get_weather", "arguments": {"city": "Paris"}') == []
    assert extractor.feed("}, {") == [WEATHER]
    assert extractor.feed('"name": "get_time", "arguments": {"zone": "CET"}}]') == [TIME]
    assert extractor.finish() == []


def test_required_cut_short_keeps_released_calls() -> None:
    text = '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_ti'
    assert extract_all("required", text) == (', {"name": "get_ti', [WEATHER])
    assert extract_all("required", '[{"name": "get_weather"') == ('[{"name": "get_weather"', [])


def test_required_strings_may_hold_brackets_and_escaped_quotes() -> None:
    text = '[{"name": "echo", "arguments": {"s": "}]\\"{[\\\\"}}]'
    assert extract_all("required", text) == (None, [ToolCall("echo", '{"s": "}]\\"{[\\\\"}')])


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("[]", "[]", []),
        ("  ", "  ", []),
        ("", "", []),
        ('{"name": "f", "arguments": {}}', '{"name": "f", "arguments": {}}', []),
        ('[{"name": "f", "arguments": {}},]', ",]", [F]),
        ('[{"name": "f", "arguments": {}}] x', "] x", [F]),
        ('[{"name": "f"}}', "}", [F]),
        ('[{"name": "f"}, {"name": 1}]', ', {"name": 1}]', [F]),
        ('[{"name": "f", "arguments": {]}]', '[{"name": "f", "arguments": {]}]', []),
        ('[1, {"name": "f"}]', '[1, {"name": "f"}]', []),
    ],
)
def test_required_content_from_the_first_invalid_element(
    text: str, content: str, calls: list[ToolCall]
) -> None:
    expected = (None if calls and not content.strip() else content, calls)
    assert extract_all("required", text) == expected


def test_required_unicode_arguments_are_kept() -> None:
    text = '[{"name": "greet", "arguments": {"who": "Zoë 😊"}}]'
    assert extract_all("required", text) == (None, [ToolCall("greet", '{"who": "Zoë 😊"}')])


# --- every mode -------------------------------------------------------------------------------


def test_parser_names_and_unknown_mode() -> None:
    assert PARSER_NAMES == ("hermes", "llama3_json")
    with pytest.raises(ValueError, match="mistral"):
        make_extractor("mistral")
    with pytest.raises(ValueError):
        extract_all("auto", "text")


@pytest.mark.parametrize(
    ("mode", "text", "released", "held"),
    [
        ("hermes", "x <tool", ["x "], "<tool"),
        ("hermes", "<tool_call>{", [], "<tool_call>{"),
        ("llama3_json", " {", [], " {"),
        ("required", "[{", [], "[{"),
    ],
)
def test_finish_releases_held_text_once(
    mode: str, text: str, released: list[Piece], held: str
) -> None:
    extractor = make_extractor(mode)
    assert extractor.feed(text) == released
    assert extractor.finish() == [held]
    assert extractor.finish() == []


@pytest.mark.parametrize("mode", MODES)
def test_empty_and_whitespace_texts(mode: str) -> None:
    assert extract_all(mode, "") == ("", [])
    assert extract_all(mode, " \n ") == (" \n ", [])
    extractor = make_extractor(mode)
    assert extractor.feed("") == []
    assert extractor.finish() == []


CORPUS = {
    "hermes": [
        QWEN_BLOCK,
        f"Checking.\n{QWEN_BLOCK}\n{TIME_BLOCK}\nDone <",
        '<tool_call>[{"name": "a", "arguments": {}}, {"name": "b"}]</tool_call>',
        "a < b <tool <tool_call <</tool_call> <tool_call>bad</tool_call> x",
        '<tool_call>{"name": "a", "arguments": {"s": "</tool_call"}}</tool_call>',
        "<tool_call><tool_call>{}</tool_call></tool_call>",
        '<tool_call>{"name": "a", "arguments": {"k": "é"}}',
        "plain text with no tags, just <b>html</b>",
    ],
    "llama3_json": [
        '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}',
        ' \n{"name": "a", "arguments": "{\\"x\\": [1, 2]}"}',
        "<|python_tag|>not json",
        "<|python_tag> almost",
        "  Hello, {world}; bye",
        '{"name": "a", "parameters": {}}; junk',
    ],
    "required": [
        REQUIRED,
        ' [ {"name": "a", "arguments": {"s": "\\"}]"}} ,{"name": "b", "arguments": {}} ] ',
        '[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": [1, {"y": "',
        '[{"name": "a", "arguments": {}}, 3]',
        "[{}]",
        "not an array",
    ],
}


@pytest.mark.parametrize(("mode", "text"), [(m, t) for m in MODES for t in CORPUS[m]])
def test_any_split_gives_the_same_pieces(mode: str, text: str) -> None:
    _assert_split_invariant(mode, text, random.Random(len(text)))


CALL = '{"name": "f", "arguments": {"a": "}"}}'


@pytest.mark.parametrize("mode", MODES)
def test_random_texts_split_invariant(mode: str) -> None:
    """Texts stitched from format fragments, so that tags and brackets meet in odd places."""
    fragments = [
        "<tool_call>", "</tool_call>", "<tool", "_call>", "<|python_tag|>", "<|py", "{", "}",
        "[", "]", '"', "\\", ",", ";", " ", "\n", '"name"', ": ", '"f"', '"arguments"', "{}",
        "é", "x", CALL, '<tool_call>{"name": "f"}</tool_call>',
    ]  # fmt: skip
    rng = random.Random(7)
    texts_with_calls = 0
    for _ in range(300):
        text = "".join(rng.choice(fragments) for _ in range(rng.randint(0, 14)))
        if rng.random() < 0.5:  # open with a call, so that every mode finds some
            text = (
                rng.choice(["[", "<|python_tag|>", " "]) + CALL + rng.choice([",", ";", ""]) + text
            )
        expected = _whole(mode, text)
        texts_with_calls += any(isinstance(piece, ToolCall) for piece in expected)
        assert _stream(mode, list(text)) == expected, text
        if len(text) > 1:
            assert _stream(mode, _random_split(text, rng)) == expected, text
        if not any(isinstance(piece, ToolCall) for piece in expected):
            assert "".join(piece for piece in expected if isinstance(piece, str)) == text
    assert texts_with_calls >= 5  # the fragments do make calls, in every mode


@pytest.mark.parametrize(
    ("mode", "text"),
    [
        ("hermes", "<tool_call>" + "[" * 100_000 + "]" * 100_000 + "</tool_call>"),
        ("hermes", "<tool_call>" + "[" * 100_000),
        ("hermes", '<tool_call>{"name": "f", "arguments": "' + "[" * 100_000 + '"}</tool_call>'),
        ("llama3_json", '{"name": "f", "parameters": ' + "[" * 100_000 + "]" * 100_000 + "}"),
        ("llama3_json", "{" + '"a":{' * 100_000),
        ("required", '[{"name": "f", "arguments": {"x": ' + "[" * 100_000 + "]" * 100_000 + "}}]"),
        ("required", "[{" + '"a":{' * 100_000),
    ],
)
def test_deep_nesting_is_content_not_a_crash(mode: str, text: str) -> None:
    assert extract_all(mode, text) == (text, [])


LARGE = 200_000  # characters fed one at a time: large, yet quick on a slow machine
_BIG = 'x;{\\"' * (LARGE // 6)  # JSON string text: a ';', a '{', an escaped quote
_BIG_VALUE = 'x;{"' * (LARGE // 6)


def _big(prefix: str, suffix: str) -> str:
    return prefix + '{"name": "f", "arguments": {"s": "' + _BIG + '"}}' + suffix


@pytest.mark.parametrize(
    ("mode", "text", "expected"),
    [
        ("hermes", "a < b; " * (LARGE // 7), None),
        ("hermes", _big("<tool_call>", ""), [ToolCall("f", json.dumps({"s": _BIG_VALUE}))]),
        ("llama3_json", "Once upon a time { " * (LARGE // 19), None),
        ("llama3_json", _big("", ";"), [ToolCall("f", json.dumps({"s": _BIG_VALUE}))]),
        ("required", _big("[", "]"), [ToolCall("f", json.dumps({"s": _BIG_VALUE}))]),
        ("required", "[" + '{"name": "f"}, ' * (LARGE // 15) + "{", [F] * (LARGE // 15) + [", {"]),
    ],
)
def test_large_text_one_character_at_a_time(
    mode: str, text: str, expected: list[Piece] | None
) -> None:
    extractor = make_extractor(mode)
    pieces: list[Piece] = []
    for char in text:
        pieces += extractor.feed(char)
    assert _merge(pieces + extractor.finish()) == (expected or [text])
    assert _whole(mode, text) == (expected or [text])
