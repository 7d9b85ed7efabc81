"""EngineCore: the scheduler, the KV cache and the model executor, stepped in a loop."""

from __future__ import annotations

import functools
import logging
import os
import queue
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from corefleet.engine.config import EngineConfig
from corefleet.engine.core.pooling import pooler_info, prepare_pooling_request
from corefleet.engine.core.scheduler import Scheduler
from corefleet.engine.core.scheduler_output import (
    GrammarOutput,
    ModelRunnerOutput,
    SchedulerOutput,
    attach_token_ids,
)
from corefleet.engine.core.step_stats import StepTokenHistogram
from corefleet.engine.engine_core.startup import StartupClock
from corefleet.engine.frontend.tokenizer import Tokenizer
from corefleet.engine.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    ReadyResponse,
    SchedulerStats,
    validate_prompt,
)
from corefleet.engine.models.default_model import served_model_name
from corefleet.engine.models.loader import load_arch_config, resolve_model_path
from corefleet.engine.pooler_config import parse_pooler_config
from corefleet.engine.request import Request, RequestStatus
from corefleet.engine.structured_output.manager import StructuredOutputManager
from corefleet.engine.worker.executor import Executor, ExecutorFactory, resolve_executor_class

logger = logging.getLogger(__name__)

_Method = TypeVar("_Method", bound=Callable[..., Any])
_UTILITY_MARK = "__corefleet_utility__"


def utility(method: _Method) -> _Method:
    """Mark a method as callable by clients (a UTILITY request); nothing else is."""
    setattr(method, _UTILITY_MARK, True)
    return method


class UnknownUtilityError(RuntimeError):
    """A client asked for a method that is not a ``@utility`` of the engine."""


class EngineCore:
    """One data-parallel rank's engine: ``step()`` = schedule -> execute -> update."""

    def __init__(
        self,
        config: EngineConfig,
        executor_class: ExecutorFactory | None = None,
        clock: StartupClock | None = None,
    ) -> None:
        clock = clock or StartupClock()
        if executor_class is None:
            executor_class = resolve_executor_class(config.parallel.executor_backend)
        started = time.perf_counter()
        self.model_path = resolve_model_path(config.model.model)
        arch = load_arch_config(self.model_path)
        explicit_max_model_len = config.model.max_model_len is not None
        self.config = config = _resolve_max_model_len(config, arch.max_position_embeddings)
        assert config.model.max_model_len is not None
        self.max_model_len: int = config.model.max_model_len
        self.vocab_size = arch.vocab_size
        configured = config.model.max_logprobs
        self.max_logprobs = self.vocab_size if configured == -1 else configured
        self.eos_token_id = arch.eos_token_ids[0] if arch.eos_token_ids else None
        # --runner pooling: what the vectors are (None: this engine generates).
        self.pooler_info = pooler_info(config, arch.hidden_size, self.model_path)
        self.pooler_dimensions = parse_pooler_config(config.model.pooler_config).dimensions

        self.executor: Executor = executor_class(config, self.model_path)
        clock.phase("model (kernels and weights)")
        self.num_blocks = self.executor.determine_num_blocks()
        self.executor.initialize_kv_cache(self.num_blocks)
        clock.phase("KV cache")
        block_size = config.cache.block_size
        self.max_model_len = _fit_to_kv_cache(
            self.max_model_len, (self.num_blocks - 1) * block_size, explicit_max_model_len
        )
        self.step_tokens = StepTokenHistogram()  # for EngineStats (vllm:iteration_tokens)
        self.scheduler = Scheduler(
            config.scheduler, config.cache, self.num_blocks, self.max_model_len, block_size
        )
        # The scheduler's own hasher (None without prefix caching): one per engine.
        self.block_hasher = self.scheduler.block_hasher
        # Aborts that arrive from other threads while the model runs; applied before the
        # step's results so a request aborted during its last step ends ABORTED, not LENGTH.
        self.aborts_queue: queue.SimpleQueue[list[str]] = queue.SimpleQueue()
        # Grammars (structured outputs); the model's tokenizer is loaded by the first one.
        self.structured_output = StructuredOutputManager(
            functools.partial(_tokenizer_json, self.model_path), self.vocab_size, self.eos_token_id
        )
        self._idle_waiters: list[Future[None]] = []
        # Pipeline parallelism: up to one step in flight per stage (the seeds' batch queue).
        self.batch_queue_size = config.parallel.pipeline_parallel_size
        self.batch_queue: deque[tuple[Future[ModelRunnerOutput | None], SchedulerOutput]] | None
        self.batch_queue = deque() if self.batch_queue_size > 1 else None
        logger.info(
            "engine ready in %.1f s: max_model_len=%d, %d KV blocks of %d tokens (%d tokens)",
            time.perf_counter() - started,
            self.max_model_len,
            self.num_blocks,
            block_size,
            (self.num_blocks - 1) * block_size,
        )

    # ---- requests -------------------------------------------------------------------------

    def preprocess_add_request(self, request: EngineCoreRequest) -> Request:
        """Validate a wire request and build the engine-side Request; ValueError if invalid."""
        if not isinstance(request.request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request.request_id).__name__}")
        validate_prompt(request.prompt_token_ids, self.max_model_len, self.vocab_size)
        request = prepare_pooling_request(request, self.pooler_info, self.pooler_dimensions)
        params = request.sampling_params
        params.validate(self.vocab_size, self.max_logprobs)
        prepared = Request.from_engine_core_request(request, self.eos_token_id, self.block_hasher)
        if params.structured_outputs is not None:
            # Compiles in the manager's pool; the scheduler admits the request once it is done.
            prepared.grammar_future = self.structured_output.grammar_init(params.structured_outputs)
            prepared.status = RequestStatus.WAITING_FOR_FSM
        return prepared

    def add_request(self, request: Request | EngineCoreRequest) -> None:
        """Queue a request; a wire request is validated first (``ValueError`` if invalid)."""
        if isinstance(request, EngineCoreRequest):
            request = self.preprocess_add_request(request)
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Finish these requests as aborted (unknown or finished ids are ignored)."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    # ---- the loop -------------------------------------------------------------------------

    def step(self) -> tuple[dict[int, EngineCoreOutputs], bool]:
        """Run one batch; returns the outputs per client and whether the model ran."""
        if self.batch_queue is not None:
            return self._step_with_batch_queue(self.batch_queue)
        if not self.scheduler.has_requests():
            return {}, False
        scheduler_output = self.scheduler.schedule()
        self.step_tokens.observe(scheduler_output.total_num_scheduled_tokens)
        future = self.executor.execute_model(scheduler_output, non_block=True)
        # While the model runs: the allowed tokens of the batch's constrained requests.
        grammar_output = self._grammar_bitmask(scheduler_output)
        model_output = future.result()
        if model_output is None:  # the runner waits for the grammar's mask to sample
            assert grammar_output is not None
            model_output = self.executor.sample_tokens(grammar_output)
        self._process_aborts_queue()
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        return outputs, scheduler_output.total_num_scheduled_tokens > 0

    def _step_with_batch_queue(
        self, batch_queue: deque[tuple[Future[ModelRunnerOutput | None], SchedulerOutput]]
    ) -> tuple[dict[int, EngineCoreOutputs], bool]:
        """The seeds' step for pipeline parallelism: while fewer than ``pipeline_parallel_size``
        steps are in flight, schedule and launch one and return at once; otherwise (or with
        nothing left to schedule: every running request waits for its token) wait for the
        oldest and update from it. A request in flight has no token to compute, so the
        scheduler leaves it out of the next steps until its output is in."""
        launched = False
        if len(batch_queue) < self.batch_queue_size and self.scheduler.has_requests():
            scheduler_output = self.scheduler.schedule()
            self.step_tokens.observe(scheduler_output.total_num_scheduled_tokens)
            if (
                scheduler_output.total_num_scheduled_tokens
                or scheduler_output.finished_req_ids
                or scheduler_output.preempted_req_ids
            ):
                scheduler_output.grammar = self._grammar_bitmask(scheduler_output)
                attach_token_ids(scheduler_output, self.scheduler.requests)
                future = self.executor.execute_model(scheduler_output, non_block=True)
                batch_queue.append((future, scheduler_output))
                launched = scheduler_output.total_num_scheduled_tokens > 0
        if not batch_queue:
            return {}, False
        if launched and len(batch_queue) < self.batch_queue_size:
            return {}, True  # room for another step before waiting for this one
        future, scheduler_output = batch_queue.popleft()
        model_output = future.result()
        assert model_output is not None  # the masks went with the step
        self._process_aborts_queue()
        return self.scheduler.update_from_output(scheduler_output, model_output), True

    def _grammar_bitmask(self, scheduler_output: SchedulerOutput) -> GrammarOutput | None:
        req_ids = scheduler_output.structured_output_req_ids
        if not req_ids:
            return None
        requests = self.scheduler.requests
        matchers = [requests[req_id].matcher for req_id in req_ids]
        return GrammarOutput(req_ids, self.structured_output.grammar_bitmask(matchers))

    def _process_aborts_queue(self) -> None:
        ids: list[str] = []
        while True:
            try:
                ids.extend(self.aborts_queue.get_nowait())
            except queue.Empty:
                break
        if ids:
            self.abort_requests(ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def complete_idle_waiters(self) -> None:
        """Answer :meth:`wait_until_idle` callers once no request is left.

        Whoever steps the engine calls it after handing out a step's outputs, so a waiter's
        reply always comes after the last outputs of the requests it waited for.
        """
        if self._idle_waiters and not self.scheduler.has_unfinished_requests():
            waiters, self._idle_waiters = self._idle_waiters, []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

    # ---- what clients see -------------------------------------------------------------------

    def make_ready_response(self, rank: int) -> ReadyResponse:
        """What this engine serves, as it tells a client first: the ``engine_info`` of both the
        in-process client and a client of an engine process."""
        block_size = self.config.cache.block_size
        model = self.config.model
        return ReadyResponse(
            rank=rank,
            max_model_len=self.max_model_len,
            num_gpu_blocks=self.num_blocks,
            block_size=block_size,
            kv_cache_size_tokens=(self.num_blocks - 1) * block_size,
            vocab_size=self.vocab_size,
            model_name=served_model_name(model.served_model_name, model.model, self.model_path),
            pid=os.getpid(),
            max_num_seqs=self.config.scheduler.max_num_seqs,
            pooler=self.pooler_info,
            cache_dtype=self.config.cache.cache_dtype,
            enable_prefix_caching=self.config.cache.enable_prefix_caching,
            scheduling_policy=self.config.scheduler.policy,
            max_logprobs=self.max_logprobs,
        )

    def get_utility(self, name: str) -> Callable[..., Any]:
        """The ``@utility`` method called ``name``, bound to this engine.

        Raises :class:`UnknownUtilityError` for anything else; private names are refused
        before any lookup, so a client can never reach the engine's internals.
        """
        method = None if name.startswith("_") else getattr(self, name, None)
        if not callable(method) or getattr(method, _UTILITY_MARK, False) is not True:
            raise UnknownUtilityError(f"unknown utility method {name!r}")
        return method

    # ---- utilities (UTILITY requests) -------------------------------------------------------

    @utility
    def get_scheduler_stats(self) -> SchedulerStats:
        """Queue lengths, KV usage and cumulative prefix-cache and preemption counters."""
        return self.scheduler.make_stats()

    @utility
    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block; False (nothing changed) while requests hold blocks."""
        return self.scheduler.reset_prefix_cache()

    @utility
    def get_num_unfinished_requests(self) -> int:
        """Requests queued or running, not yet finished."""
        return self.scheduler.get_num_unfinished_requests()

    @utility
    def wait_until_idle(self) -> Future[None] | None:
        """Returns at once when idle, else a Future completed when the last request finishes
        (over the wire the reply is deferred until then)."""
        if not self.scheduler.has_unfinished_requests():
            return None
        waiter: Future[None] = Future()
        self._idle_waiters.append(waiter)
        return waiter

    def shutdown(self) -> None:
        """Stop the executor; the engine cannot step afterwards."""
        self.structured_output.shutdown()
        self.executor.shutdown()


def _tokenizer_json(model_path: str) -> str:
    """The model's tokenizer as a Hugging Face ``tokenizers`` JSON string (for grammars)."""
    return Tokenizer.from_model_path(model_path).backend.to_str()


def _resolve_max_model_len(config: EngineConfig, model_limit: int) -> EngineConfig:
    requested = config.model.max_model_len
    if requested is None:
        return config.with_max_model_len(model_limit)
    if requested > model_limit:
        raise ValueError(
            f"invalid engine argument max_model_len={requested}: the model supports at most "
            f"{model_limit} positions"
        )
    return config


def _fit_to_kv_cache(max_model_len: int, kv_tokens: int, explicit: bool) -> int:
    """The context length a request may reach: at most what the KV cache holds. A longer
    request could never run alone, and would be preempted and recomputed forever.

    Raises:
        ValueError: ``--max-model-len`` was given and the cache cannot hold it (as vLLM).
    """
    if max_model_len <= kv_tokens:
        return max_model_len
    if explicit:
        raise ValueError(
            f"invalid engine argument max_model_len={max_model_len}: the KV cache holds "
            f"{kv_tokens} tokens; raise --kv-cache-memory (or --gpu-memory-utilization) or "
            "lower --max-model-len"
        )
    logger.warning(
        "the KV cache holds %d tokens, fewer than the model's %d positions: requests are "
        "limited to %d tokens (raise --kv-cache-memory or --gpu-memory-utilization for more)",
        kv_tokens,
        max_model_len,
        kv_tokens,
    )
    return kv_tokens
