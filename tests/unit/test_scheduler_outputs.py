"""Scheduler stop rules, aborts, outputs and stats."""

from __future__ import annotations

import pytest

from corefleet.engine.core.scheduler import Scheduler
from corefleet.engine.core.scheduler_output import ModelRunnerOutput
from corefleet.engine.messages import EngineCoreOutput, FinishReason, Logprobs
from corefleet.engine.request import Request, RequestStatus
from tests.unit.scheduler_helpers import (
    EOS,
    assert_no_leaks,
    fake_runner,
    make_request,
    make_scheduler,
    outputs_by_id,
    script,
    step,
)

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


@pytest.mark.parametrize("stop_at", [0, 5, 15, 16, 17])
def test_stop_token_between_block_boundaries_stops_at_once(stop_at: int) -> None:
    """The per-token fast path lets a stop token through to the full rules wherever it falls
    relative to a block boundary, and hashes the blocks filled before it."""
    sched = make_scheduler()
    req = make_request(sched, "a", 16, stop_token_ids=[9])  # the prompt is one full block
    tokens = [5] * stop_at + [9, 5, 5]
    outs = run_one(sched, req, tokens)
    assert req.output_token_ids == [5] * stop_at + [9]
    assert (outs[-1].finish_reason, outs[-1].stop_reason) == (FinishReason.STOP, 9)
    assert len(req.block_hashes) == len(req.all_token_ids) // 16
    assert [o.num_cached_tokens for o in outs] == [0] * len(outs)
    assert_no_leaks(sched)
