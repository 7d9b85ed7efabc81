"""Builders shared by the scheduler tests: schedulers, requests and a scripted fake runner."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from corefleet.engine.config import CacheConfig, SchedulerConfig, SchedulingPolicy
from corefleet.engine.core.scheduler import Scheduler
from corefleet.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from corefleet.engine.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    SamplingParams,
)
from corefleet.engine.request import Request

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


def assert_no_leaks(sched: Scheduler) -> None:
    kv = sched.kv_cache_manager
    assert not sched.requests and not sched.running and not sched.waiting
    assert not kv.req_to_blocks and not kv.num_cached_block
    assert kv.num_free_blocks == kv.block_pool.num_blocks - 1
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
