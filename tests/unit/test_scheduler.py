"""Scheduler: budgets, chunked prefill, preemption, stop rules and outputs, with a fake runner."""

from __future__ import annotations

import pytest

from corefleet.engine.core.block_hash import hash_block_tokens
from corefleet.engine.messages import FinishReason
from corefleet.engine.request import RequestStatus
from tests.unit.scheduler_helpers import (
    TOKEN,
    assert_no_leaks,
    fake_runner,
    make_request,
    make_scheduler,
    outputs_by_id,
    step,
)

# ------------------------------------------------------------------------------ lifecycle


def test_add_and_abort_waiting() -> None:
    sched = make_scheduler()
    reqs = [make_request(sched, str(i), 10) for i in range(4)]
    assert [r.request_id for r in sched.waiting] == ["0", "1", "2", "3"]
    assert sched.get_num_unfinished_requests() == 4
    finished = sched.finish_requests("1", RequestStatus.FINISHED_ABORTED)
    assert finished == [reqs[1]] and reqs[1].status == RequestStatus.FINISHED_ABORTED
    assert "1" not in sched.requests and [r.request_id for r in sched.waiting] == ["0", "2", "3"]
    assert sched.get_num_unfinished_requests() == 3
    assert sched.finish_requests(["1", "nope"], RequestStatus.FINISHED_ABORTED) == []
    assert sched.schedule().finished_req_ids == {"1"}


def test_finish_all_requests() -> None:
    sched = make_scheduler()
    for name in "abc":
        make_request(sched, name, 20)
    step(sched)
    make_request(sched, "d", 5)
    finished = sched.finish_requests(None, RequestStatus.FINISHED_ABORTED)
    assert sorted(r.request_id for r in finished) == ["a", "b", "c", "d"]
    assert not sched.has_unfinished_requests() and sched.has_requests()
    assert sched.kv_cache_manager.usage == 0.0
    with pytest.raises(ValueError, match="not a finished status"):
        sched.finish_requests(None, RequestStatus.RUNNING)
    assert sched.schedule().finished_req_ids == {"a", "b", "c", "d"}
    assert not sched.has_requests()


def test_add_request_validation() -> None:
    sched = make_scheduler(max_model_len=32)
    with pytest.raises(ValueError, match=r"the prompt has 40 tokens but .*\(max_model_len\) is 32"):
        make_request(sched, "long", 40)
    with pytest.raises(ValueError, match="at most 31 tokens, to leave room for the output"):
        make_request(sched, "full", 32)
    make_request(sched, "a", 5)
    with pytest.raises(ValueError, match="duplicate"):
        make_request(sched, "a", 5)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make_scheduler(chunked=False, max_num_batched_tokens=64, max_model_len=128)


def test_first_schedule_admits_all_in_order() -> None:
    sched = make_scheduler(max_num_batched_tokens=2048)
    for i in range(10):
        make_request(sched, str(i), 10 + i)
    out = sched.schedule()
    assert [r.req_id for r in out.scheduled_new_reqs] == [str(i) for i in range(10)]
    assert out.num_scheduled_tokens == {str(i): 10 + i for i in range(10)}
    assert out.total_num_scheduled_tokens == sum(range(10, 20))
    assert not out.scheduled_cached_reqs.req_ids and not out.finished_req_ids
    assert [r.request_id for r in sched.running] == [str(i) for i in range(10)]
    new = out.scheduled_new_reqs[3]
    assert len(new.token_ids) == 13 and new.num_computed_tokens == 0
    assert new.block_ids == sched.kv_cache_manager.get_block_ids("3")


# ------------------------------------------------------------------------------ budgets


def test_chunked_prefill_splits_prompt_and_emits_nothing_until_done() -> None:
    sched = make_scheduler(max_num_batched_tokens=64)
    req = make_request(sched, "a", 150)
    out, eo = step(sched)
    assert out.num_scheduled_tokens == {"a": 64} and len(out.scheduled_new_reqs) == 1
    assert outputs_by_id(eo) == {}  # partial prefill: no output, but stats still flow
    assert eo[0].scheduler_stats is not None
    assert req.num_computed_tokens == 64
    out, eo = step(sched)
    assert out.num_scheduled_tokens == {"a": 64}
    cached = out.scheduled_cached_reqs
    assert list(zip(cached.req_ids, cached.num_computed_tokens, strict=True)) == [("a", 64)]
    assert outputs_by_id(eo) == {}
    out, eo = step(sched)
    assert out.num_scheduled_tokens == {"a": 22}
    assert outputs_by_id(eo)["a"].new_token_ids == [TOKEN]
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 1}  # decode


def test_running_first_then_waiting_under_budget() -> None:
    sched = make_scheduler(max_num_batched_tokens=64)
    make_request(sched, "a", 100)
    make_request(sched, "b", 10)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 64}  # no budget left for b
    sched.update_from_output(out, fake_runner(sched, out))
    make_request(sched, "c", 50)
    out = sched.schedule()
    # a finishes its prompt first, then b fits, then c gets what is left.
    assert out.num_scheduled_tokens == {"a": 36, "b": 10, "c": 18}
    assert out.total_num_scheduled_tokens == 64
    assert out.scheduled_cached_reqs.req_ids == ["a"]
    assert [r.req_id for r in out.scheduled_new_reqs] == ["b", "c"]


def test_token_budget_invariants_over_many_steps() -> None:
    sched = make_scheduler(max_num_batched_tokens=48, max_num_seqs=5, num_blocks=64)
    for i in range(12):
        make_request(sched, str(i), 5 + 7 * i, max_tokens=3 + i % 4)
    for _ in range(200):
        if not sched.has_requests():
            break
        out, _ = step(sched)
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        assert out.total_num_scheduled_tokens <= 48
        assert len(sched.running) <= 5
    assert not sched.has_requests()
    assert_no_leaks(sched)


def test_max_num_seqs_bounds_admission() -> None:
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=512)
    for i in range(5):
        make_request(sched, str(i), 8, max_tokens=2)
    out, _ = step(sched)
    assert [r.req_id for r in out.scheduled_new_reqs] == ["0", "1"]
    assert sched.get_request_counts() == (2, 3)
    out, _ = step(sched)  # 0 and 1 finish (max_tokens=2)
    assert not out.scheduled_new_reqs
    out, _ = step(sched)
    assert out.finished_req_ids == {"0", "1"}
    assert [r.req_id for r in out.scheduled_new_reqs] == ["2", "3"]


def test_chunked_prefill_disabled_keeps_order() -> None:
    sched = make_scheduler(chunked=False, max_num_batched_tokens=64, max_model_len=64)
    make_request(sched, "a", 40)
    make_request(sched, "b", 40)
    make_request(sched, "c", 5)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 40}  # b does not fit whole; c may not jump it


def test_chunked_prefill_enabled_admits_both_long_prompts() -> None:
    sched = make_scheduler(max_num_batched_tokens=64)
    make_request(sched, "a", 40)
    make_request(sched, "b", 40)
    assert sched.schedule().num_scheduled_tokens == {"a": 40, "b": 24}


# ------------------------------------------------------------------------------ preemption


@pytest.mark.parametrize("caching", [False, True])
def test_fcfs_preempts_last_and_resumes_with_all_tokens(caching: bool) -> None:
    sched = make_scheduler(num_blocks=6, block_size=4, caching=caching)  # 5 usable blocks
    make_request(sched, "a", 8, max_tokens=2)
    b = make_request(sched, "b", 8)
    step(sched)  # both prompts: 4 blocks
    out, eo = step(sched)  # a takes the last block; b needs one too and is preempted
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.preempted_req_ids == {"b"}
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and sched.num_preemptions == 1
    assert [r.request_id for r in sched.waiting] == ["b"]
    assert outputs_by_id(eo)["a"].finish_reason == FinishReason.LENGTH
    assert eo[0].scheduler_stats is not None and eo[0].scheduler_stats.num_preemptions == 1

    out, eo = step(sched)  # a's blocks are back: b resumes as a new request
    assert out.finished_req_ids == {"a"}
    (new,) = out.scheduled_new_reqs
    assert new.req_id == "b"
    assert new.token_ids == [*b.prompt_token_ids, TOKEN]
    assert new.num_output_tokens == 1
    assert len(new.block_ids) == 3
    # With the prefix cache, b's two full blocks survived its preemption.
    assert new.num_computed_tokens == (8 if caching else 0)
    assert out.num_scheduled_tokens == {"b": 9 - new.num_computed_tokens}
    assert outputs_by_id(eo)["b"].new_token_ids == [TOKEN]
    assert b.output_token_ids == [TOKEN, TOKEN]
    assert b.num_cached_tokens == 0  # set at first admission only, not on resumption


def test_fcfs_victim_is_last_running() -> None:
    sched = make_scheduler(num_blocks=7, block_size=4, caching=False)  # 6 usable
    for name in "abc":
        make_request(sched, name, 8)
    step(sched)  # 2 blocks each
    out, _ = step(sched)  # a needs a 3rd block: c (last) goes; b then takes c's other block
    assert out.preempted_req_ids == {"c"}
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    assert [r.request_id for r in sched.running] == ["a", "b"]


def test_priority_victim_and_no_admission_in_preempting_step() -> None:
    sched = make_scheduler(num_blocks=7, block_size=4, caching=False, policy="priority")
    make_request(sched, "a", 8)
    make_request(sched, "b", 6)
    make_request(sched, "c", 8)
    step(sched)  # 2 blocks each; 0 free
    make_request(sched, "d", 2, priority=-1)  # urgent, needs one block
    out, _ = step(sched)
    # Equal priority: the latest arrival (c) is the victim. One block is then free, but a step
    # that preempted admits nobody.
    assert out.preempted_req_ids == {"c"}
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    assert sched.kv_cache_manager.num_free_blocks == 1
    out, _ = step(sched)
    assert [r.req_id for r in out.scheduled_new_reqs] == ["d"]  # ahead of c by priority
    assert [r.request_id for r in sched.waiting] == ["c"]


def test_priority_preempts_lowest_priority_already_scheduled() -> None:
    sched = make_scheduler(num_blocks=7, block_size=4, caching=False, policy="priority")
    make_request(sched, "a", 5, priority=0)
    make_request(sched, "b", 5, priority=5)
    step(sched)  # running [a, b], 2 blocks each
    make_request(sched, "c", 8, priority=1)
    step(sched)  # running [a, b, c]; all 6 blocks used
    out, _ = step(sched)
    # c needs a block; b (lowest priority) was already scheduled this step: it is refunded.
    assert out.preempted_req_ids == {"b"}
    assert out.num_scheduled_tokens == {"a": 1, "c": 1}
    assert out.scheduled_cached_reqs.req_ids == ["a", "c"]
    assert [r.request_id for r in sched.running] == ["a", "c"]
    assert sched.requests["b"].num_computed_tokens == 0


def test_priority_policy_orders_waiting() -> None:
    sched = make_scheduler(policy="priority", max_num_seqs=3, max_num_batched_tokens=512)
    make_request(sched, "low", 4, priority=3)
    make_request(sched, "mid-early", 4, priority=1)
    make_request(sched, "high", 4, priority=0)
    make_request(sched, "mid-late", 4, priority=1)
    out = sched.schedule()
    assert [r.req_id for r in out.scheduled_new_reqs] == ["high", "mid-early", "mid-late"]
    assert [r.request_id for r in sched.waiting] == ["low"]


def test_reset_prefix_cache_with_running_requests() -> None:
    sched = make_scheduler(policy="fcfs")
    for name in "abc":
        make_request(sched, name, 20)
    step(sched)
    assert not sched.reset_prefix_cache()
    assert sched.reset_prefix_cache(reset_running_requests=True)
    assert [r.request_id for r in sched.waiting] == ["a", "b", "c"]


@pytest.mark.parametrize("block_size", [1, 2, 4, 16])
def test_decode_across_block_boundaries_allocates_and_caches_each_block(block_size: int) -> None:
    """Decode tokens that stay inside a held block skip the KV manager; the token that fills a
    block and the one that opens the next still go through it (every token at block sizes 1
    and 2)."""
    sched = make_scheduler(block_size=block_size)
    request = make_request(sched, "a", 14, max_tokens=40)
    kv = sched.kv_cache_manager
    step(sched)  # prefill: 14 tokens
    for _ in range(38):  # the 40th token (39th decode step) finishes it
        step(sched)
        held = len(kv.req_to_blocks["a"])
        assert held == -(-request.num_computed_tokens // block_size)  # just the blocks needed
        full = request.num_computed_tokens // block_size
        assert kv.num_cached_block["a"] == full  # full ones cached, under the prefix's hashes
        assert request.block_hashes == _chained_hashes(request.all_token_ids, block_size)
    step(sched)
    assert request.is_finished
    assert_no_leaks(sched)


def _chained_hashes(tokens: list[int], block_size: int) -> list[bytes]:
    """Every full block's hash, computed from scratch."""
    hashes: list[bytes] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block_tokens(parent, tokens[start : start + block_size]))
    return hashes
