"""Completions' echo and vLLM's prompt_logprobs as the responses build them (``echo.py``), and
``usage.prompt_tokens_details``; parsed by the official client's types."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

from openai.types import Completion

from corefleet.engine.frontend.input_processor import ProcessedPrompt
from corefleet.engine.frontend.outputs import TokenLogprob
from corefleet.engine.openai import protocol as p
from corefleet.engine.openai.echo import CompletionEcho, prompt_logprobs_entries
from corefleet.engine.openai.serving import ChoiceDelta, Generation

PROMPT_IDS = [11, 12, 13]
# The engine's prompt rows: nothing predicts the first token; then the token and the top-1.
PROMPT_ROWS: list[dict[int, TokenLogprob] | None] = [
    None,
    {12: TokenLogprob(-2.0, 3, "b"), 40: TokenLogprob(-0.5, 1, "x")},
    {13: TokenLogprob(float("-inf"), 900, "c"), 41: TokenLogprob(-0.1, 1, "y")},
]
OUTPUT_ROW = {50: TokenLogprob(-0.25, 1, "!")}


class _Tokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join({11: "a", 12: "b", 13: "c"}.get(i, "?") for i in ids)


def _generation(prompt: str | None) -> Any:
    """What CompletionEcho reads of a Generation: its prompts, n and the tokenizer, and the
    prompt's text as Generation itself gives it."""
    generation = SimpleNamespace(
        processed=[ProcessedPrompt(prompt, PROMPT_IDS)],
        params=SimpleNamespace(n=1),
        processor=SimpleNamespace(tokenizer=_Tokenizer()),
        prompt_token_ids=lambda choice: PROMPT_IDS,
    )
    generation.prompt_text = lambda choice: Generation.prompt_text(generation, choice)  # type: ignore[arg-type]
    return generation


def _body(**fields: Any) -> p.CompletionRequest:
    return p.CompletionRequest.model_validate({"prompt": "abc", **fields})


async def _collect(echo: CompletionEcho, deltas: list[ChoiceDelta]) -> list[ChoiceDelta]:
    async def source() -> AsyncIterator[ChoiceDelta]:
        for d in deltas:
            yield d

    return [d async for d in echo.deltas(source())]


def _deltas() -> list[ChoiceDelta]:
    first = ChoiceDelta(0, "!", [50], [OUTPUT_ROW], prompt_logprobs=PROMPT_ROWS)
    last = ChoiceDelta(0, "?", [51], [{51: TokenLogprob(-1.0, 1, "?")}], finish_reason="length")
    last.full_text = "!?"
    return [first, last]


def test_echo_puts_the_prompt_first_and_its_logprobs_before_the_answer() -> None:
    echo = CompletionEcho(_body(echo=True, logprobs=1), _generation("abc"))
    first, last = asyncio.run(_collect(echo, _deltas()))
    assert (first.text, last.text, last.full_text) == ("abc!", "?", "abc!?")
    lp = echo.logprobs(first, 1, 0)
    assert lp.tokens == ["a", "b", "c", "!"]
    assert lp.token_logprobs == [None, -2.0, -9999.0, -0.25]  # -inf clamped
    assert lp.top_logprobs[0] is None and lp.top_logprobs[1] == {"b": -2.0, "x": -0.5}
    assert lp.text_offset == [0, 1, 2, 3]
    assert echo.logprobs(last, 1, 4).tokens == ["?"]  # only a choice's first delta has them
    choice = p.CompletionChoice(index=0, text="abc!?", logprobs=lp, finish_reason="length")
    response = p.CompletionResponse(model="m", choices=[choice])
    # The official client reads it (its types say floats, but it does not validate: the null
    # first entry is vLLM's, and what lm-evaluation-harness expects).
    parsed = Completion.construct(**json.loads(response.model_dump_json()))
    read = parsed.choices[0].logprobs
    assert read is not None and read.token_logprobs == [None, -2.0, -9999.0, -0.25]


def test_echo_with_max_tokens_0_is_the_prompt_alone() -> None:
    echo = CompletionEcho(_body(echo=True, max_tokens=0, logprobs=0), _generation(None))
    (only,) = asyncio.run(_collect(echo, [_deltas()[1]]))
    # A token-id prompt is echoed decoded; the engine's one token is dropped.
    assert (only.text, only.full_text, only.token_ids, only.logprobs) == ("abc", "abc", [], [])
    only.prompt_logprobs = PROMPT_ROWS
    echo = CompletionEcho(_body(echo=True, max_tokens=0, logprobs=0), _generation(None))
    (only,) = asyncio.run(_collect(echo, [only]))
    assert only.text == "abc"
    assert echo.logprobs(only, 0, 0).tokens == ["a", "b", "c"]


def test_without_echo_nothing_changes() -> None:
    echo = CompletionEcho(_body(logprobs=1), _generation("abc"))
    first, _ = asyncio.run(_collect(echo, _deltas()))
    assert first.text == "!" and echo.logprobs(first, 1, 0).tokens == ["!"]


def test_prompt_logprobs_entries_are_vllm_s_shape() -> None:
    entries = prompt_logprobs_entries(PROMPT_ROWS)
    choice = p.CompletionChoice(index=0, text="", prompt_logprobs=entries)
    dumped = json.loads(choice.model_dump_json())["prompt_logprobs"]
    assert dumped[0] is None
    assert dumped[2]["13"] == {"logprob": -9999.0, "rank": 900, "decoded_token": "c"}
    assert prompt_logprobs_entries(None) is None


def test_prompt_tokens_details_only_when_set() -> None:
    usage = p.UsageInfo(prompt_tokens=40, completion_tokens=1)
    assert "prompt_tokens_details" not in json.loads(usage.model_dump_json())
    usage.prompt_tokens_details = p.PromptTokenUsageInfo(cached_tokens=32)
    assert usage.model_dump()["prompt_tokens_details"] == {"cached_tokens": 32}
