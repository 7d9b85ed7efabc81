"""What the scheduler hands the model runner each step, and what comes back."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from corefleet.engine.messages import Logprobs, PoolingParams, SamplingParams
from corefleet.engine.request import Request


@dataclass
class NewRequestData:
    """A request the runner has not seen (or must rebuild after preemption)."""

    req_id: str
    token_ids: list[int]  # prompt plus any tokens generated before a preemption
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # tokens already in the KV cache (prefix-cache hits)
    num_output_tokens: int = 0  # trailing entries of token_ids that are generated tokens
    pooling_params: PoolingParams | None = None  # a pooling request (``--runner pooling``)


@dataclass
class CachedRequestData:
    """Running requests the runner already holds state for, as parallel lists (one object per
    step rather than one per request: this is built for every running request every step)."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)  # blocks allocated this step
    num_computed_tokens: list[int] = field(default_factory=list)  # before this step
    # Pipeline parallelism only: the token ids each request computes this step. No worker
    # samples what the next step needs in time (the last stage samples, steps later), so the
    # engine says it; empty otherwise.
    new_token_ids: list[list[int]] = field(default_factory=list)

    def remove(self, req_id: str) -> None:
        """Drop one request's entries (a request preempted after it was scheduled)."""
        i = self.req_ids.index(req_id)
        del self.req_ids[i], self.new_block_ids[i], self.num_computed_tokens[i]


@dataclass
class GrammarOutput:
    """The allowed tokens of a step's constrained requests, computed while the model ran."""

    req_ids: list[str]  # row k of ``banned`` is for req_ids[k]
    banned: np.ndarray  # [K, V] bool: True where the grammar forbids the token


@dataclass
class SchedulerOutput:
    """One step's work: which requests run and how many tokens each computes."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests that finished or were preempted since the previous step: runners drop their state.
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # Requests with a grammar that sample a token this step, in the order of the engine's
    # grammar bitmask rows (structured outputs); empty for most batches.
    structured_output_req_ids: list[str] = field(default_factory=list)
    # Pipeline parallelism only: their masks, computed before the step is launched (its
    # requests are not in flight, so their matchers are current). Otherwise the engine
    # computes them while the model runs and hands them to sample_tokens.
    grammar: GrammarOutput | None = None


@dataclass
class ModelRunnerOutput:
    """Sampled tokens per scheduled request (empty list while a prompt is still prefilling)."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: dict[str, Logprobs] = field(default_factory=dict)
    # The whole prompt's logprobs of requests whose prompt this step completed (their first
    # sampled token is in ``sampled_token_ids``); ``engine.worker.prompt_logprobs``.
    prompt_logprobs: dict[str, Logprobs] = field(default_factory=dict)
    # ``--runner pooling``: the vectors (float32 bytes) of the requests whose prompt this step
    # completed; they sample nothing (``engine.worker.pooler``).
    pooler_output: dict[str, bytes] = field(default_factory=dict)


def attach_token_ids(output: SchedulerOutput, requests: Mapping[str, Request]) -> None:
    """Fill ``output.scheduled_cached_reqs.new_token_ids`` (pipeline parallelism) from the
    scheduled requests' tokens."""
    cached, scheduled = output.scheduled_cached_reqs, output.num_scheduled_tokens
    cached.new_token_ids = [
        requests[req_id].all_token_ids[start : start + scheduled[req_id]]
        for req_id, start in zip(cached.req_ids, cached.num_computed_tokens, strict=True)
    ]
