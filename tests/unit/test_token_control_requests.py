"""Token-level controls in requests: the engine's validation and the OpenAI fields, each at
absurd values (a 400 naming the field, never an engine error)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from corefleet.engine.messages import SamplingParams
from corefleet.engine.openai.errors import RequestError, parse_request
from corefleet.engine.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
)
from corefleet.engine.openai.sampling_request import to_sampling_params
from corefleet.engine.openai.token_request import below_pattern
from corefleet.engine.token_controls import (
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_LOGPROB_TOKEN_IDS,
)
from tests.unit.openai_helpers import CHAT, COMPLETION

VOCAB = 1000


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"logit_bias": {VOCAB: 1.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {i: 1.0 for i in range(MAX_LOGIT_BIAS_TOKENS + 1)}}, "logit_bias"),
        ({"logit_bias": {3: float("nan")}}, "logit_bias"),
        ({"logit_bias": {"3": 1.0}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [1, VOCAB]}, "allowed_token_ids"),
        ({"allowed_token_ids": [1] * (VOCAB + 1)}, "allowed_token_ids"),
        ({"logprob_token_ids": [VOCAB]}, "logprob_token_ids"),
        ({"logprob_token_ids": [1] * (MAX_LOGPROB_TOKEN_IDS + 1)}, "logprob_token_ids"),
        ({"logprob_token_ids": [1, 2], "logprobs": 5}, "logprob_token_ids"),
        ({"bad_words": [""]}, "bad_words"),
        ({"bad_words": ["x"] * (MAX_BAD_WORDS + 1)}, "bad_words"),
        ({"bad_words_token_ids": [[]]}, "bad_words_token_ids"),
        ({"bad_words_token_ids": [[1, VOCAB]]}, "bad_words"),
    ],
)
def test_the_engine_refuses_bad_controls_naming_the_field(
    fields: dict[str, Any], field: str
) -> None:
    with pytest.raises(ValueError, match=f"parameter {field}="):
        SamplingParams(**fields).validate(VOCAB)


def test_good_controls_pass() -> None:
    SamplingParams(
        logit_bias={0: -100.0, VOCAB - 1: 100},
        allowed_token_ids=[0, 5, VOCAB - 1],
        bad_words=["no"],
        bad_words_token_ids=[[4, 5]],
        logprob_token_ids=[1, 2],
        logprobs=2,
    ).validate(VOCAB)


def _params(kind: type, body: dict[str, Any]) -> SamplingParams:
    return to_sampling_params(parse_request(kind, body), VOCAB)


def _refused(kind: type, body: dict[str, Any]) -> RequestError:
    with pytest.raises(RequestError) as info:
        _params(kind, body)
    assert info.value.status == 400
    return info.value


def test_logit_bias_keys_become_ids_and_values_are_clamped() -> None:
    params = _params(CompletionRequest, {**COMPLETION, "logit_bias": {"5": 1e9, "7": -300}})
    assert params.logit_bias == {5: 100.0, 7: -100.0}


def test_the_fields_reach_the_engine_on_both_endpoints() -> None:
    fields = {"allowed_token_ids": [3, 4], "bad_words": ["hello"], "logit_bias": {"3": 2}}
    for kind, base in ((CompletionRequest, COMPLETION), (ChatCompletionRequest, CHAT)):
        params = _params(kind, {**base, **fields})
        assert params.allowed_token_ids == [3, 4]
        assert params.bad_words == ["hello"]
        assert params.logit_bias == {3: 2.0}


def test_logprob_token_ids_replace_the_top_n_and_need_logprobs() -> None:
    chat = _params(ChatCompletionRequest, {**CHAT, "logprobs": True, "logprob_token_ids": [9, 8]})
    assert (chat.logprobs, chat.logprob_token_ids) == (None, [9, 8])
    body = {**COMPLETION, "logprobs": 1, "logprob_token_ids": [9, 8, 7]}
    completion = _params(CompletionRequest, body)
    assert (completion.logprobs, completion.logprob_token_ids) == (None, [9, 8, 7])
    for kind, base in ((CompletionRequest, COMPLETION), (ChatCompletionRequest, CHAT)):
        err = _refused(kind, {**base, "logprob_token_ids": [1]})
        assert err.param == "logprob_token_ids"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"logit_bias": {"9" * 5000: 1.0}}, "logit_bias"),
        ({"logit_bias": {str(VOCAB): 1.0}}, "logit_bias"),
        ({"logit_bias": {"-3": 1.0}}, "logit_bias"),
        ({"logit_bias": {"1": "high"}}, "logit_bias"),
        ({"logit_bias": {str(i): 1.0 for i in range(100_000)}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [2**70]}, "allowed_token_ids"),
        ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
        ({"allowed_token_ids": [VOCAB + 5]}, "allowed_token_ids"),
        ({"allowed_token_ids": [1] * 1_000_000}, "allowed_token_ids"),
        ({"bad_words": [""]}, "bad_words"),
        ({"bad_words": ["x"] * 100_000}, "bad_words"),
        ({"bad_words": ["x" * 100_000]}, "bad_words"),
        ({"bad_words": "word"}, "bad_words"),
        ({"logprobs": 1, "logprob_token_ids": [VOCAB]}, "logprob_token_ids"),
        ({"logprobs": 1, "logprob_token_ids": list(range(100_000))}, "logprob_token_ids"),
    ],
)
def test_absurd_values_are_a_400_naming_the_field(fields: dict[str, Any], param: str) -> None:
    assert _refused(CompletionRequest, {**COMPLETION, **fields}).param == param


@pytest.mark.parametrize("n", [1, 2, 10, 11, 57, 100, 320, 1001])
def test_the_documented_logit_bias_keys_are_exactly_the_vocabulary(n: int) -> None:
    pattern = re.compile(below_pattern(n))
    assert [i for i in range(3 * n + 20) if pattern.match(str(i))] == list(range(n))
    assert not pattern.match("01") and not pattern.match("-1") and not pattern.match("")


def test_integral_floats_are_token_ids() -> None:
    params = _params(CompletionRequest, {**COMPLETION, "allowed_token_ids": [2.0, 3]})
    assert params.allowed_token_ids == [2, 3]
    assert _refused(CompletionRequest, {**COMPLETION, "allowed_token_ids": [2.5]}).param == (
        "allowed_token_ids"
    )
