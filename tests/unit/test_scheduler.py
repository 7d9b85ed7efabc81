"""Scheduler: budgets, chunked prefill, preemption, stop rules and outputs, with a fake runner."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from corefleet.engine.config import CacheConfig, SchedulerConfig, SchedulingPolicy
from corefleet.engine.core.outputs import ModelRunnerOutput, SchedulerOutput
from corefleet.engine.core.scheduler import Scheduler
from corefleet.engine.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    Logprobs,
    SamplingParams,
)
from corefleet.engine.request import Request, RequestStatus

TOKEN = 7  # what the fake runner samples unless told otherwise
EOS = 2


def make_scheduler(
    *,
    num_blocks: int = 1000,
    block_size: int = 16,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    chunked: bool = True,
    policy: SchedulingPolicy = "fcfs",
    caching: bool = True,
    max_model_len: int = 1024,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=chunked,
            policy=policy,
        ),
        CacheConfig(block_size=block_size, enable_prefix_caching=caching),
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        block_size=block_size,
    )


_clock = iter(range(1_000_000))


def make_request(
    sched: Scheduler,
    req_id: str,
    prompt: int | list[int],
    *,
    priority: int = 0,
    client_index: int = 0,
    **params: Any,
) -> Request:
    # Integer prompts are distinct per request so that they never share a cached prefix.
    base = 1000 * next(_clock)
    tokens = list(range(base, base + prompt)) if isinstance(prompt, int) else prompt
    request = Request(
        req_id,
        tokens,
        SamplingParams(**{"max_tokens": 100, **params}),
        eos_token_id=EOS,
        arrival_time=float(next(_clock)),
        priority=priority,
        client_index=client_index,
        block_hasher=sched.block_hasher,
    )
    sched.add_request(request)
    return request


def fake_runner(
    sched: Scheduler, out: SchedulerOutput, sample: Callable[[str], list[int]] | None = None
) -> ModelRunnerOutput:
    """Sample for every request whose scheduled tokens reach its end; nothing mid-prefill."""
    req_ids = list(out.num_scheduled_tokens)
    sampled: list[list[int]] = []
    for req_id in req_ids:
        req = sched.requests.get(req_id)
        done = req is None or req.num_computed_tokens >= req.num_tokens
        sampled.append((sample(req_id) if sample else [TOKEN]) if done else [])
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


def step(
    sched: Scheduler, sample: Callable[[str], list[int]] | None = None
) -> tuple[SchedulerOutput, dict[int, EngineCoreOutputs]]:
    out = sched.schedule()
    return out, sched.update_from_output(out, fake_runner(sched, out, sample))


def outputs_by_id(engine_outputs: dict[int, EngineCoreOutputs]) -> dict[str, EngineCoreOutput]:
    return {o.request_id: o for eo in engine_outputs.values() for o in eo.outputs}


def script(tokens: dict[str, list[int]]) -> Callable[[str], list[int]]:
    """A runner that samples the given tokens per request, one per step."""
    return lambda req_id: [tokens[req_id].pop(0)]


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
    with pytest.raises(ValueError, match="prompt of 40 tokens exceeds max_model_len 32"):
        make_request(sched, "long", 40)
    with pytest.raises(ValueError, match="no room"):
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


# ------------------------------------------------------------------------------ stop rules


def run_one(sched: Scheduler, req: Request, tokens: list[int]) -> list[EngineCoreOutput]:
    sample = script({req.request_id: list(tokens)})
    outs: list[EngineCoreOutput] = []
    for _ in range(100):
        if req.request_id not in sched.requests:
            return outs
        _, eo = step(sched, sample)
        outs.extend(outputs_by_id(eo).values())
    raise AssertionError(f"{req.request_id} did not finish")


def test_stop_on_eos() -> None:
    sched = make_scheduler()
    req = make_request(sched, "a", 5)
    outs = run_one(sched, req, [5, 6, EOS, 8])
    assert [o.new_token_ids for o in outs] == [[5], [6], [EOS]]
    assert outs[-1].finish_reason == FinishReason.STOP and outs[-1].stop_reason is None
    assert req.status == RequestStatus.FINISHED_STOPPED and not sched.running
    assert sched.schedule().finished_req_ids == {"a"}


def test_stop_token_id_sets_stop_reason() -> None:
    sched = make_scheduler()
    req = make_request(sched, "a", 5, stop_token_ids=[9])
    outs = run_one(sched, req, [5, 9, 6])
    assert outs[-1].new_token_ids == [9]
    assert (outs[-1].finish_reason, outs[-1].stop_reason) == (FinishReason.STOP, 9)


def test_max_tokens_caps_length() -> None:
    sched = make_scheduler()
    req = make_request(sched, "a", 5, max_tokens=3)
    outs = run_one(sched, req, [5, 6, 8, 9])
    assert req.output_token_ids == [5, 6, 8]
    assert outs[-1].finish_reason == FinishReason.LENGTH


def test_ignore_eos_keeps_going() -> None:
    sched = make_scheduler()
    req = make_request(sched, "a", 5, max_tokens=3, ignore_eos=True)
    run_one(sched, req, [EOS, EOS, EOS])
    assert req.output_token_ids == [EOS, EOS, EOS]
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_min_tokens_suppresses_eos_and_stop_tokens() -> None:
    sched = make_scheduler()
    req = make_request(sched, "a", 5, min_tokens=3, stop_token_ids=[9])
    outs = run_one(sched, req, [EOS, 9, 9, 4])
    assert req.output_token_ids == [EOS, 9, 9]
    assert (outs[-1].finish_reason, outs[-1].stop_reason) == (FinishReason.STOP, 9)


def test_max_model_len_stops_even_below_min_tokens() -> None:
    sched = make_scheduler(max_model_len=8)
    req = make_request(sched, "a", 5, max_tokens=None, min_tokens=10)
    outs = run_one(sched, req, [5, 6, 7, 8])
    assert req.output_token_ids == [5, 6, 7] and req.num_tokens == 8
    assert outs[-1].finish_reason == FinishReason.LENGTH


def test_tokens_after_stop_are_dropped_with_their_logprobs() -> None:
    sched = make_scheduler()
    make_request(sched, "a", 5, stop_token_ids=[9])
    out = sched.schedule()
    logprobs = Logprobs(
        token_ids=[[5], [9], [6]], logprobs=[[-0.1], [-0.2], [-0.3]], sampled_ranks=[1, 1, 1]
    )
    runner = ModelRunnerOutput(["a"], [[5, 9, 6]], logprobs={"a": logprobs})
    output = outputs_by_id(sched.update_from_output(out, runner))["a"]
    assert output.new_token_ids == [5, 9] and output.stop_reason == 9
    assert output.new_logprobs is not None and output.new_logprobs.sampled_ranks == [1, 1]
    assert output.new_logprobs.token_ids == [[5], [9]]


def test_logprobs_passed_through() -> None:
    sched = make_scheduler()
    make_request(sched, "a", 5)
    out = sched.schedule()
    logprobs = Logprobs(token_ids=[[5, 1]], logprobs=[[-0.1, -2.0]], sampled_ranks=[1])
    runner = ModelRunnerOutput(["a"], [[5]], logprobs={"a": logprobs})
    assert outputs_by_id(sched.update_from_output(out, runner))["a"].new_logprobs == logprobs


# ------------------------------------------------------------------------------ aborts, outputs


def test_abort_running_frees_blocks_and_reports_finished() -> None:
    sched = make_scheduler()
    make_request(sched, "a", 40)
    keep = make_request(sched, "b", 40)
    step(sched)
    free_before = sched.kv_cache_manager.num_free_blocks
    assert sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)[0].request_id == "a"
    assert sched.kv_cache_manager.num_free_blocks == free_before + 3
    assert sched.running == [keep]
    assert sched.finish_requests("a", RequestStatus.FINISHED_ABORTED) == []  # idempotent
    assert sched.has_finished_requests()
    out = sched.schedule()
    assert out.finished_req_ids == {"a"} and list(out.num_scheduled_tokens) == ["b"]
    assert not sched.has_finished_requests()


def test_abort_during_step_drops_its_tokens() -> None:
    sched = make_scheduler()
    make_request(sched, "a", 5)
    make_request(sched, "b", 5)
    out = sched.schedule()
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    eo = sched.update_from_output(out, fake_runner(sched, out))
    assert set(outputs_by_id(eo)) == {"b"}


def test_outputs_grouped_by_client_with_stats_once() -> None:
    sched = make_scheduler()
    make_request(sched, "a", 5, client_index=0)
    make_request(sched, "b", 5, client_index=1)
    _, eo = step(sched)
    assert {k: [o.request_id for o in v.outputs] for k, v in eo.items()} == {0: ["a"], 1: ["b"]}
    assert sum(v.scheduler_stats is not None for v in eo.values()) == 1


def test_stats_on_empty_step() -> None:
    sched = make_scheduler()
    _, eo = step(sched)
    stats = eo[0].scheduler_stats
    assert eo[0].outputs == [] and stats is not None and stats.step_counter == 1


def test_prefix_hit_counted_in_stats_and_num_cached_tokens() -> None:
    sched = make_scheduler(max_num_batched_tokens=256)
    prompt = list(range(1000, 1040))
    first = make_request(sched, "a", prompt, max_tokens=1)
    run_one(sched, first, [5])
    make_request(sched, "b", [*prompt, 1, 2], max_tokens=2)
    out, eo = step(sched)
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 32 and out.num_scheduled_tokens == {"b": 10}
    assert outputs_by_id(eo)["b"].num_cached_tokens == 32
    stats = eo[0].scheduler_stats
    assert stats is not None
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (82, 32)
    _, eo = step(sched)
    assert outputs_by_id(eo)["b"].num_cached_tokens == 0  # only on the first output


def test_stats_report_counts_and_usage() -> None:
    sched = make_scheduler(max_num_seqs=1, num_blocks=11)
    make_request(sched, "a", 20)
    make_request(sched, "b", 20)
    stats = sched.make_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (0, 2)
    step(sched)
    stats = sched.make_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (1, 1)
    assert stats.kv_cache_usage == pytest.approx(0.2)


def assert_no_leaks(sched: Scheduler) -> None:
    kv = sched.kv_cache_manager
    assert not sched.requests and not sched.running and not sched.waiting
    assert not kv.req_to_blocks and not kv.num_cached_block
    assert kv.num_free_blocks == kv.block_pool.num_blocks - 1
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)


def test_no_leaks_after_mixed_workload_with_preemption() -> None:
    sched = make_scheduler(num_blocks=12, block_size=4, max_num_batched_tokens=32)
    for i in range(8):
        make_request(sched, str(i), 6 + i, max_tokens=6)
    sched.finish_requests("5", RequestStatus.FINISHED_ABORTED)
    for _ in range(300):
        if not sched.has_requests():
            break
        step(sched)
    assert sched.num_preemptions > 0
    assert_no_leaks(sched)
