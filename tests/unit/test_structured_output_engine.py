"""Grammars in the engine: the manager's masks on SmolLM2's tokenizer, and the scheduler's
WAITING_FOR_FSM (a request waits for its compile without holding up the queue)."""

from __future__ import annotations

import json
from concurrent.futures import Future
from typing import Any

import pytest

from corefleet.engine.core.scheduler import Scheduler
from corefleet.engine.frontend.tokenizer import Tokenizer
from corefleet.engine.messages import SamplingParams, StructuredOutputsParams
from corefleet.engine.request import Request, RequestStatus
from corefleet.engine.structured_output.manager import GrammarError, StructuredOutputManager
from tests.unit.scheduler_helpers import (
    assert_no_leaks,
    make_request,
    make_scheduler,
    outputs_by_id,
    step,
)


@pytest.fixture(scope="module")
def tokenizer(smollm2_path: str) -> Tokenizer:
    return Tokenizer.from_model_path(smollm2_path)


@pytest.fixture(scope="module")
def manager(tokenizer: Tokenizer) -> StructuredOutputManager:
    eos = tokenizer.eos_token_id
    return StructuredOutputManager(lambda: tokenizer.backend.to_str(), tokenizer.vocab_size, eos)


def test_the_mask_allows_exactly_the_tokens_that_continue_the_grammar(
    manager: StructuredOutputManager, tokenizer: Tokenizer
) -> None:
    matcher = manager.grammar_init(StructuredOutputsParams(choice=["yes", "no"])).result(60)
    allowed = ~manager.grammar_bitmask([matcher])  # [1, V]
    assert allowed.shape == (1, tokenizer.vocab_size)
    texts = {tokenizer.decode([int(t)], skip_special_tokens=False) for t in allowed[0].nonzero()[0]}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts)
    assert "yes" in texts and "no" in texts
    for token in tokenizer.encode("yes", add_special_tokens=False):
        assert matcher.consume_token(token)
    # Complete: only EOS may follow.
    assert (~manager.grammar_bitmask([matcher]))[0].nonzero()[0].tolist() == [
        tokenizer.eos_token_id
    ]


def test_compiled_grammars_are_cached_and_each_request_has_its_own_matcher(
    manager: StructuredOutputManager, tokenizer: Tokenizer
) -> None:
    params = StructuredOutputsParams(regex="[0-9]{3}")
    first = manager.grammar_init(params).result(60)
    second = manager.grammar_init(params)
    assert second.done()  # from the cache: no compile
    one, two = first, second.result()
    assert one is not two
    for token in tokenizer.encode("12", add_special_tokens=False):
        assert one.consume_token(token)
    # The second matcher is still at the start: it allows a first digit, not EOS.
    allowed = ~manager.grammar_bitmask([one, two])
    assert not allowed[1][tokenizer.eos_token_id] and allowed[0].any() and allowed[1].any()


def _allows_another_key(matcher: Any, manager: StructuredOutputManager, tok: Tokenizer) -> bool:
    """Whether, after ``{"a": 1``, the matcher allows a token that starts another key."""
    for token in tok.encode('{"a": 1', add_special_tokens=False):
        assert matcher.consume_token(token)
    allowed = (~manager.grammar_bitmask([matcher]))[0].nonzero()[0]
    texts = {tok.decode([int(t)], skip_special_tokens=False) for t in allowed}
    return any(t.lstrip().startswith(",") for t in texts)


def test_json_objects_are_closed_by_default_and_the_cache_keeps_both_settings_apart(
    manager: StructuredOutputManager, tokenizer: Tokenizer
) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    closed = StructuredOutputsParams(json=json.dumps(schema))  # the default: vLLM's strict
    assert not _allows_another_key(manager.grammar_init(closed).result(60), manager, tokenizer)
    # Same text, the option off: compiled anew (a cache keyed on the text alone would hand
    # back the closed grammar), and JSON Schema's letter allows undeclared keys.
    loose = StructuredOutputsParams(json=json.dumps(schema), disable_additional_properties=False)
    assert _allows_another_key(manager.grammar_init(loose).result(60), manager, tokenizer)
    assert not _allows_another_key(manager.grammar_init(closed).result(60), manager, tokenizer)
    # An explicit additionalProperties is honoured either way.
    open_schema = schema | {"additionalProperties": {"type": "integer"}}
    explicit = StructuredOutputsParams(json=json.dumps(open_schema))
    assert _allows_another_key(manager.grammar_init(explicit).result(60), manager, tokenizer)


def test_a_grammar_that_fails_against_the_tokenizer_is_a_grammar_error(
    manager: StructuredOutputManager,
) -> None:
    future = manager.grammar_init(StructuredOutputsParams(grammar="start: missing_rule"))
    with pytest.raises(GrammarError, match=r"structured_outputs\.grammar"):
        future.result(60)


def _waiting_for(sched: Scheduler, req_id: str, future: Future[object]) -> Request:
    request = make_request(sched, req_id, 8, max_tokens=3)
    request.sampling_params = SamplingParams(max_tokens=3)
    request.grammar_future = future  # type: ignore[assignment]
    request.status = RequestStatus.WAITING_FOR_FSM
    return request


class _AnyToken:
    """A matcher that accepts every token (the scheduler only feeds it)."""

    def __init__(self) -> None:
        self.consumed: list[int] = []

    def consume_tokens(self, tokens: list[int]) -> bool:
        self.consumed += tokens
        return True

    def get_error(self) -> str:
        return ""


def test_a_request_waits_for_its_grammar_without_holding_up_the_queue() -> None:
    sched = make_scheduler()
    compiling: Future[object] = Future()
    constrained = _waiting_for(sched, "g", compiling)
    make_request(sched, "free", 8, max_tokens=3)
    out, _ = step(sched)
    assert list(out.num_scheduled_tokens) == ["free"]  # passed over, not blocking
    assert (
        constrained.status == RequestStatus.WAITING_FOR_FSM and sched.waiting.peek() is constrained
    )
    matcher = _AnyToken()
    compiling.set_result(matcher)
    out, _ = step(sched)
    assert "g" in out.num_scheduled_tokens and constrained.matcher is matcher
    assert out.structured_output_req_ids == ["g"]  # the prompt is done: it samples this step
    while sched.has_unfinished_requests():
        step(sched)
    assert len(matcher.consumed) == 3
    assert_no_leaks(sched)


def test_a_failed_compile_finishes_its_request_with_an_error_and_leaks_nothing() -> None:
    sched = make_scheduler()
    failing: Future[object] = Future()
    _waiting_for(sched, "g", failing)
    failing.set_exception(ValueError("invalid structured_outputs.regex: unclosed group"))
    _, outputs = step(sched)
    failed = outputs_by_id(outputs)["g"]
    assert str(failed.finish_reason) == "error" and "unclosed group" in str(failed.stop_reason)
    assert_no_leaks(sched)


def test_aborting_a_request_whose_grammar_compiles_frees_it() -> None:
    sched = make_scheduler()
    compiling: Future[object] = Future()
    _waiting_for(sched, "g", compiling)
    sched.finish_requests("g", RequestStatus.FINISHED_ABORTED)
    compiling.set_result(_AnyToken())  # arrives after the abort: nothing happens
    step(sched)
    assert_no_leaks(sched)
