"""Incremental detokenizer (on SmolLM2's GGUF and the tiny HF tokenizer) and stop strings."""

from __future__ import annotations

import pytest

from corefleet.engine.frontend.detokenizer import IncrementalDetokenizer, check_stop_strings
from corefleet.engine.frontend.tokenizer import Tokenizer
from tests.fixtures_models import write_tiny_tokenizer
from tests.unit.tokenizer_helpers import CONVERSATIONS, MULTIBYTE


@pytest.fixture(scope="module")
def smol(smollm2_path: str) -> Tokenizer:
    return Tokenizer.from_model_path(smollm2_path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("tok") / "absent"
    write_tiny_tokenizer(folder)
    return Tokenizer.from_model_path(folder)


# -- incremental detokenizer --------------------------------------------------------------


def _check_streaming(tok: Tokenizer, prompt: list[int], ids: list[int]) -> None:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=True)
    deltas = [detok.add_tokens([i]) for i in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == tok.decode(ids) == detok.output_text
    assert not any("\ufffd" in d for d in deltas)
    assert detok.output_token_ids == ids
    # Some token ended mid-character, so some step released nothing.
    assert "" in deltas[:-1]


@pytest.mark.slow
def test_gguf_incremental_detokenizer_multibyte(smol: Tokenizer) -> None:
    prompt = smol.encode(smol.apply_chat_template(CONVERSATIONS[0]))
    ids = smol.encode(MULTIBYTE + "<|im_end|>")
    _check_streaming(smol, prompt, ids)


def test_incremental_detokenizer_multibyte_tiny(tiny: Tokenizer) -> None:
    prompt = tiny.encode(tiny.apply_chat_template(CONVERSATIONS[0]))
    ids = tiny.encode(MULTIBYTE)
    assert len(ids) > len(MULTIBYTE) // 2  # the tiny vocabulary splits characters into bytes
    _check_streaming(tiny, prompt, ids)


def test_incremental_detokenizer_holds_back_partial_character(tiny: Tokenizer) -> None:
    ids = tiny.encode("a😀")
    emoji_ids = ids[1:]
    assert len(emoji_ids) > 1  # the emoji spans several tokens
    detok = IncrementalDetokenizer(tiny, [], skip_special_tokens=True)
    assert detok.add_tokens(ids[:1]) == "a"
    for i in emoji_ids[:-1]:
        assert detok.add_tokens([i]) == ""
    assert detok.add_tokens(emoji_ids[-1:]) == "😀"
    assert detok.flush() == ""


def test_incremental_detokenizer_flush_and_batches(tiny: Tokenizer) -> None:
    ids = tiny.encode("x😀")
    detok = IncrementalDetokenizer(tiny, tiny.encode("prompt"), skip_special_tokens=True)
    assert detok.add_tokens(ids[:-1]) == "x"  # several ids at once; the emoji is incomplete
    assert detok.flush() == "\ufffd"  # finished mid-character: what a full decode shows
    assert detok.output_text == tiny.decode(ids[:-1])
    assert detok.add_tokens([]) == ""


def test_incremental_detokenizer_special_tokens(tiny: Tokenizer) -> None:
    ids = tiny.encode("hi<|im_end|>")
    skipping = IncrementalDetokenizer(tiny, [], skip_special_tokens=True)
    keeping = IncrementalDetokenizer(tiny, [], skip_special_tokens=False)
    assert "".join(skipping.add_tokens([i]) for i in ids) == "hi"
    assert "".join(keeping.add_tokens([i]) for i in ids) == "hi<|im_end|>"


# -- stop strings -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "delta", "stops", "include", "expected"),
    [
        ("hello world", 5, [], False, None),
        ("hello world", 0, ["world"], False, None),
        ("hello world", 5, ["xyz"], False, None),
        ("hello world", 5, ["world"], False, ("world", 6)),
        ("hello world", 5, ["world"], True, ("world", 11)),
        ("hello world", 3, ["o w"], False, None),  # wholly in old text: found earlier
        ("hello world", 3, ["lo wor"], False, ("lo wor", 3)),  # spans old and new text
        ("a STOP b END c", 12, ["END", "STOP"], False, ("STOP", 2)),  # earliest wins
        ("a STOP b END c", 12, ["END", "STOP"], True, ("STOP", 6)),
        ("a STOP b END c", 8, ["END", "STOP"], False, ("END", 9)),  # STOP was in old text
        ("xxab", 2, ["ab", "a"], False, ("ab", 2)),  # same start: earlier entry wins
        ("abc", 3, ["", "c"], False, ("c", 2)),  # empty stop strings are ignored
    ],
)
def test_check_stop_strings(
    text: str,
    delta: int,
    stops: list[str],
    include: bool,
    expected: tuple[str, int] | None,
) -> None:
    assert check_stop_strings(text, delta, stops, include) == expected


def test_stop_string_streaming_finds_first_occurrence() -> None:
    text, found = "", None
    for piece in ["The ans", "wer is", " 42.", " Done", ". The", " end."]:
        text += piece
        found = check_stop_strings(text, len(piece), [".", "Done"], False)
        if found:
            break
    assert found == (".", len("The answer is 42"))
