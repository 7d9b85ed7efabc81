"""Logprobs in OpenAI's formats as vLLM writes them, and what a request asks its answer to carry
(``responses.Shape``): token ids, tokens named by id, usage in every chunk."""

from __future__ import annotations

import pytest

from corefleet.engine.frontend.outputs import TokenLogprob
from corefleet.engine.frontend.tokenizer import Tokenizer
from corefleet.engine.messages import SamplingParams
from corefleet.engine.openai.api_options import DEFAULT_API_OPTIONS, ApiOptions
from corefleet.engine.openai.logprobs import chat_logprobs, completion_logprobs, next_text_offset
from corefleet.engine.openai.protocol import ChatCompletionRequest, CompletionRequest
from corefleet.engine.openai.responses import Shape


@pytest.fixture(scope="module")
def smol(smollm2_path: str) -> Tokenizer:
    return Tokenizer.from_model_path(smollm2_path)


def _rows(tok: Tokenizer, ids: list[int]) -> list[dict[int, TokenLogprob]]:
    """Each token as sampled with rank 1, decoded alone as the output processor does."""
    return [{t: TokenLogprob(-0.5, 1, tok.decode([t]))} for t in ids]


def test_text_offset_never_decreases_across_a_multibyte_character(smol: Tokenizer) -> None:
    ids = smol.encode("ok 😀🚀 done", add_special_tokens=False)
    rows = _rows(smol, ids)
    assert any("\ufffd" in row[t].decoded_token for t, row in zip(ids, rows, strict=True))
    whole = completion_logprobs(ids, rows, 0, 0)
    assert whole.text_offset == sorted(whole.text_offset)
    assert len(set(whole.text_offset)) == len(ids)  # strictly increasing: no token is empty
    # Streamed a token at a time, each chunk continuing where the last one ended.
    offset, streamed = 0, []
    for t, row in zip(ids, rows, strict=True):
        chunk = completion_logprobs([t], [row], 0, offset)
        streamed += chunk.text_offset
        offset = next_text_offset(chunk, offset)
    assert streamed == whole.text_offset


def test_completion_top_logprobs_hold_the_sampled_token_first() -> None:
    row = {
        5: TokenLogprob(-3.0, 4, " sampled"),
        1: TokenLogprob(-0.1, 1, " best"),
        2: TokenLogprob(-0.9, 2, " second"),
    }
    zero = completion_logprobs([5], [row], 0, 0)
    assert zero.top_logprobs == [{" sampled": -3.0}]  # logprobs: 0 still names the token
    two = completion_logprobs([5], [row], 2, 0)
    assert list(two.top_logprobs[0]) == [" sampled", " best", " second"]
    # A sampled token among the top-N is listed once.
    again = completion_logprobs([1], [row], 2, 0)
    assert again.top_logprobs == [{" best": -0.1, " second": -0.9}]


def test_chat_top_logprobs_are_the_top_n_only() -> None:
    row = {5: TokenLogprob(-3.0, 4, " sampled"), 1: TokenLogprob(-0.1, 1, " best")}
    content = chat_logprobs([5], [row], 0).content
    assert content is not None and content[0].top_logprobs == []
    assert content[0].token == " sampled"


def test_tokens_as_token_ids() -> None:
    row = {7: TokenLogprob(-0.2, 1, "\ufffd"), 9: TokenLogprob(-2.0, 2, "x")}
    legacy = completion_logprobs([7], [row], 1, 0, as_ids=True)
    assert legacy.tokens == ["token_id:7"]
    assert legacy.top_logprobs == [{"token_id:7": -0.2}]
    assert next_text_offset(legacy) == len("token_id:7")
    chat = chat_logprobs([9], [row], 2, as_ids=True).content
    assert chat is not None
    assert chat[0].token == "token_id:9" and chat[0].bytes == list(b"token_id:9")
    assert [t.token for t in chat[0].top_logprobs] == ["token_id:7", "token_id:9"]


class _Gen:  # what Shape reads from a Generation
    params = SamplingParams(logprobs=3)


def _shape(body: dict, options: ApiOptions = DEFAULT_API_OPTIONS) -> Shape:
    request = CompletionRequest.model_validate({"prompt": "x", **body})
    return Shape.of(request, _Gen(), options)  # type: ignore[arg-type]


def test_shape_usage_options() -> None:
    assert not _shape({"stream": True}).final_usage
    usage = {"stream": True, "stream_options": {"include_usage": True}}
    assert _shape(usage).final_usage and not _shape(usage).chunk_usage
    continuous = {
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    assert _shape(continuous).chunk_usage
    # As vLLM: continuous stats without include_usage change nothing.
    alone = {"stream": True, "stream_options": {"continuous_usage_stats": True}}
    assert not _shape(alone).chunk_usage and not _shape(alone).final_usage
    forced = _shape({"stream": True}, ApiOptions(enable_force_include_usage=True))
    assert forced.final_usage and forced.chunk_usage


def test_shape_token_naming_follows_the_flag_unless_the_request_says() -> None:
    flag = ApiOptions(return_tokens_as_token_ids=True)
    assert not _shape({}).as_ids
    assert _shape({}, flag).as_ids
    assert not _shape({"return_tokens_as_token_ids": False}, flag).as_ids
    assert _shape({"return_tokens_as_token_ids": True}).as_ids
    assert _shape({"return_token_ids": True}).token_ids and not _shape({}).token_ids
    chat = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "return_token_ids": True}
    )
    assert Shape.of(chat, _Gen(), ApiOptions()).token_ids  # type: ignore[arg-type]


def test_minus_infinity_is_openais_minus_9999() -> None:
    row = {3: TokenLogprob(float("-inf"), 5, "x"), 4: TokenLogprob(float("-inf"), 1, "y")}
    legacy = completion_logprobs([3], [row], 1, 0)
    assert legacy.token_logprobs == [-9999.0]
    assert legacy.top_logprobs == [{"x": -9999.0, "y": -9999.0}]
    assert '"-Infinity"' not in legacy.model_dump_json() and "null" not in legacy.model_dump_json()
