"""Engine-side request state."""

from __future__ import annotations

import enum
import sys
import time
from concurrent.futures import Future
from typing import Any, Protocol

from corefleet.engine.messages import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreRequest,
    FinishReason,
    PoolingParams,
    SamplingParams,
)


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request; every status after PREEMPTED is a finished one."""

    WAITING = enum.auto()
    WAITING_FOR_FSM = enum.auto()  # queued, its grammar still compiling (structured outputs)
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()
    FINISHED_REJECTED = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def finish_reason(status: RequestStatus) -> FinishReason | None:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
    RequestStatus.FINISHED_REJECTED: FinishReason.REJECTED,
}


class BlockHasher(Protocol):
    """Returns the block hashes of the request's full blocks not hashed yet."""

    block_size: int  # tokens per block: the request calls the hasher only when one fills

    def __call__(self, request: Request, /) -> list[bytes]: ...


class Request:
    """A request inside the engine: its tokens, progress and KV-cache identity."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        client_index: int = 0,
        cache_salt: str | None = None,
        block_hasher: BlockHasher | None = None,
        request_wave: int = 0,
        pooling_params: PoolingParams | None = None,
    ) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params
        # A pooling request: finished by its pooled vector once its prompt is computed.
        self.pooling_params = pooling_params
        self.eos_token_id = None if sampling_params.ignore_eos else eos_token_id
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids)
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.client_index = client_index
        self.cache_salt = cache_salt
        self.request_wave = request_wave  # the MoE group wave its sender believed current
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None

        self.prompt_token_ids = prompt_token_ids
        self.num_prompt_tokens = len(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prompt tokens found in the prefix cache (-1: not looked up)
        # vLLM's: prompt logprobs need the logits of every prompt position, which a prefix-cache
        # hit would skip; the request still writes its blocks to the cache for others.
        self.skip_reading_prefix_cache = sampling_params.prompt_logprobs is not None or (
            # Nor hidden states: MEAN and CLS pooling need every position's (or the first).
            pooling_params is not None and pooling_params.pooling_type != "LAST"
        )
        self.num_preemptions = 0
        # vLLM's lifecycle events not yet sent; the next output carries them. Created when the
        # engine receives the request, so it starts queued.
        self.events: list[EngineCoreEvent] | None = [
            EngineCoreEvent(EngineCoreEventType.QUEUED, time.monotonic())
        ]
        self.max_tokens = sampling_params.max_tokens
        # Token count (prompt + output) at which max_tokens stops the request (none: never).
        self.length_limit = (
            sys.maxsize if self.max_tokens is None else self.num_prompt_tokens + self.max_tokens
        )
        # Tokens that may stop the request (EOS unless ignore_eos, and the stop token ids): one
        # set lookup per sampled token instead of two tests.
        self.stopping_token_ids = (
            self.stop_token_ids
            if self.eos_token_id is None
            else self.stop_token_ids | {self.eos_token_id}
        )
        # Token count at which the scheduler's per-token fast path must take the full path: the
        # first output token (it reports cache hits), a block filling up (it is hashed), a
        # length limit. The scheduler moves it forward after each full-path token.
        self.next_check_at = self.num_prompt_tokens + 1

        # Structured outputs: the grammar's compile (a Future of the request's matcher) until the
        # scheduler admits the request, then the matcher it advances with every token.
        self.grammar_future: Future[Any] | None = None
        self.matcher: Any = None

        self.block_hashes: list[bytes] = []
        self._block_hasher = block_hasher
        # Token count at which the next block fills: the hasher is called only then, not after
        # every token (this runs for every running request every step; the scheduler's decode
        # path reads it directly). sys.maxsize without a hasher.
        self.next_full_block_at = sys.maxsize if block_hasher is None else self.hash_new_blocks()

    @classmethod
    def from_engine_core_request(
        cls, req: EngineCoreRequest, eos_token_id: int | None, block_hasher: BlockHasher | None
    ) -> Request:
        return cls(
            req.request_id,
            req.prompt_token_ids,
            req.sampling_params,
            eos_token_id,
            arrival_time=req.arrival_time or None,
            priority=req.priority,
            client_index=req.client_index,
            cache_salt=req.cache_salt,
            block_hasher=block_hasher,
            request_wave=req.current_wave,
            pooling_params=req.pooling_params,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def mark_scheduled(self) -> None:
        """Admitted to run, the first time or again after a preemption."""
        self.status = RequestStatus.RUNNING
        self._record_event(EngineCoreEventType.SCHEDULED)

    def mark_preempted(self) -> None:
        self.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self._record_event(EngineCoreEventType.PREEMPTED)

    def _record_event(self, event_type: EngineCoreEventType) -> None:
        event = EngineCoreEvent(event_type, time.monotonic())
        if self.events is None:
            self.events = [event]
        else:
            self.events.append(event)
        # The scheduler's fast path sends bare tokens: the next token takes the full path,
        # whose output carries the events (``core/stop.py``).
        self.next_check_at = 0

    def take_events(self) -> list[EngineCoreEvent] | None:
        events, self.events = self.events, None
        return events

    def append_output_token_ids(self, token_id: int) -> None:
        """Record one generated token and hash any block it completes."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if len(self.all_token_ids) >= self.next_full_block_at:  # never without a hasher
            self.next_full_block_at = self.hash_new_blocks()

    def hash_new_blocks(self) -> int:
        """Hash every newly full block; returns the token count that fills the next one."""
        hasher = self._block_hasher
        assert hasher is not None
        self.block_hashes += hasher(self)
        return (len(self.block_hashes) + 1) * hasher.block_size

    def __lt__(self, other: Request) -> bool:
        """Priority order: lower ``priority`` first, then earlier arrival."""
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority,
            other.arrival_time,
            other.request_id,
        )
