"""Continuous batching: which requests run each step, and how many tokens each computes.

There are no prefill and decode phases. Every request has ``num_computed_tokens`` and
``num_tokens``; each step hands out tokens so that the first catches up with the second, under
a token budget (``max_num_batched_tokens``) and a sequence cap (``max_num_seqs``). A prompt that
does not fit the budget is computed over several steps (chunked prefill); a prefix-cache hit
simply starts a request with some tokens already computed.

Running requests are served first, in admission order. When the KV cache runs out, running
requests are preempted (lowest priority / latest admitted first): their blocks are freed and
they go back to the head of the waiting queue to be recomputed, which the prefix cache usually
makes cheap. Waiting requests are admitted only in steps that preempted nothing, and never cause
a preemption themselves.
"""

from __future__ import annotations

from collections.abc import Iterable

from corefleet.engine.config import CacheConfig, SchedulerConfig
from corefleet.engine.core.block_hash import make_block_hasher
from corefleet.engine.core.grammar_steps import ConstrainedRequests
from corefleet.engine.core.kv_cache import KVCacheBlock, KVCacheManager
from corefleet.engine.core.pooling import finish_pooled
from corefleet.engine.core.request_queue import create_request_queue, preemption_victim
from corefleet.engine.core.scheduler_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from corefleet.engine.core.step_loops import NO_BLOCKS, collect_outputs, schedule_decodes
from corefleet.engine.messages import EngineCoreOutputs, SchedulerStats, validate_prompt_length
from corefleet.engine.request import BlockHasher, Request, RequestStatus

_RUNNING = RequestStatus.RUNNING
_WAITING_FOR_FSM = RequestStatus.WAITING_FOR_FSM


class Scheduler:
    """Decides each step's batch and turns the sampled tokens into engine outputs.

    ``num_blocks`` counts the null block 0. Requests should be built with
    :attr:`block_hasher` so that their full blocks can be found in the prefix cache.
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        max_model_len: int,
        block_size: int,
        log_stats: bool = True,
    ) -> None:
        if (
            not scheduler_config.enable_chunked_prefill
            and scheduler_config.max_num_batched_tokens < max_model_len
        ):
            # Otherwise a long prompt could never be admitted and would block the queue forever.
            raise ValueError(
                f"max_num_batched_tokens ({scheduler_config.max_num_batched_tokens}) must be at "
                f"least max_model_len ({max_model_len}) when chunked prefill is disabled"
            )
        self.max_num_running_reqs = scheduler_config.max_num_seqs
        self.max_num_scheduled_tokens = scheduler_config.max_num_batched_tokens
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        self.policy = scheduler_config.policy
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.log_stats = log_stats
        enable_caching = cache_config.enable_prefix_caching
        self.kv_cache_manager = KVCacheManager(
            num_blocks, block_size, enable_caching, max_model_len
        )
        # What the engine passes to Request(...): hashes only matter when caching is on.
        self.block_hasher: BlockHasher | None = (
            make_block_hasher(block_size) if enable_caching else None
        )

        self.requests: dict[str, Request] = {}  # every request not yet finished
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        # Reported (and reset) by the next schedule(): the runner drops their state.
        self.finished_req_ids: set[str] = set()
        self.preempted_req_ids: set[str] = set()
        self.num_preemptions = 0  # cumulative
        self.step_counter = 0
        # Structured outputs: which requests have grammars, and those that failed to compile.
        self.grammars = ConstrainedRequests()

    # ----------------------------------------------------------------------------- requests

    def add_request(self, request: Request) -> None:
        """Queue a new request. Raises ValueError for a duplicate id or an unservable prompt."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        validate_prompt_length(request.num_prompt_tokens, self.max_model_len)
        self.waiting.add(request)
        self.requests[request.request_id] = request

    def finish_requests(
        self, request_ids: str | Iterable[str] | None, finished_status: RequestStatus
    ) -> list[Request]:
        """Finish requests from outside (abort, error); ``None`` means all of them.

        Unknown and already finished ids are ignored, so repeating a call is harmless. Returns
        the requests actually finished; their blocks are freed at once.
        """
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"{finished_status!r} is not a finished status")
        if request_ids is None:
            request_ids = list(self.requests)
        elif isinstance(request_ids, str):
            request_ids = (request_ids,)
        finished: list[Request] = []
        running_ids: set[str] = set()
        waiting_ids: set[str] = set()
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            (running_ids if request.status == _RUNNING else waiting_ids).add(req_id)
            request.status = finished_status
            self._free_request(request)
            finished.append(request)
        if running_ids:
            self.running = [r for r in self.running if r.request_id not in running_ids]
        if waiting_ids:
            self.waiting.remove_requests(waiting_ids)
        return finished

    def _free_request(self, request: Request) -> None:
        if request.matcher is not None:
            self.grammars.num_constrained -= 1
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    # ----------------------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        """Pick this step's batch: running requests first, then waiting ones if room is left.

        Each scheduled request's ``num_computed_tokens`` advances right here, not when results
        arrive, so a following schedule() (pipelined execution) continues a chunked prefill
        instead of repeating it. The request data carries the value from before this step.
        """
        self.step_counter += 1
        num_scheduled: dict[str, int] = {}
        cached_reqs, token_budget, preempted = self._schedule_running(num_scheduled)
        # A step that had to preempt is short of blocks: admitting more would only thrash.
        new_reqs = [] if preempted else self._schedule_waiting(token_budget, num_scheduled)

        total = sum(num_scheduled.values())
        assert total <= self.max_num_scheduled_tokens
        assert len(self.running) <= self.max_num_running_reqs
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=total,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=self.preempted_req_ids,
        )
        self.finished_req_ids = set()
        self.preempted_req_ids = set()
        output.structured_output_req_ids = self.grammars.samplers(self.requests, num_scheduled)
        return output

    def _schedule_running(
        self, num_scheduled: dict[str, int]
    ) -> tuple[CachedRequestData, int, bool]:
        """Give running requests their tokens, preempting when blocks run out.

        Requests are served in order. Runs of plain decodes go through the fast path; each
        request it stops at (a prefill chunk, a request at its length limit, a decode whose new
        block is not free) goes through the general path here, which preempts until it fits.
        Returns the request data, the token budget left and whether anything was preempted.
        """
        running = self.running
        kv = self.kv_cache_manager
        max_model_len = self.max_model_len
        token_budget = self.max_num_scheduled_tokens
        scheduled = CachedRequestData()
        preempted = False
        req_index = 0
        while True:
            req_index, token_budget = schedule_decodes(
                running, req_index, token_budget, scheduled, num_scheduled, kv, max_model_len
            )
            if req_index >= len(running) or token_budget <= 0:
                return scheduled, token_budget, preempted
            request = running[req_index]
            computed = request.num_computed_tokens
            num_new = min(len(request.all_token_ids) - computed, token_budget)
            if computed + num_new >= max_model_len:
                num_new = max_model_len - 1 - computed  # leave a position for the sampled token
            if num_new <= 0:
                # Nothing to do for it now; later requests may still fill the step.
                req_index += 1
                continue
            new_blocks = kv.allocate_slots(request, num_new)
            if new_blocks is None:
                preempted = True
                new_blocks, req_index, token_budget = self._preempt_until_fits(
                    request, num_new, req_index, token_budget, scheduled, num_scheduled
                )
                if new_blocks is None:
                    return scheduled, token_budget, preempted  # nothing more fits
            req_id = request.request_id
            scheduled.req_ids.append(req_id)
            scheduled.new_block_ids.append(
                [b.block_id for b in new_blocks] if new_blocks else NO_BLOCKS
            )
            scheduled.num_computed_tokens.append(computed)
            num_scheduled[req_id] = num_new
            request.num_computed_tokens = computed + num_new
            token_budget -= num_new
            req_index += 1

    def _preempt_until_fits(
        self,
        request: Request,
        num_new: int,
        req_index: int,
        token_budget: int,
        scheduled: CachedRequestData,
        num_scheduled: dict[str, int],
    ) -> tuple[list[KVCacheBlock] | None, int, int]:
        """Preempt running requests until ``num_new`` slots of ``request`` (at ``req_index``)
        fit, or until ``request`` is the victim itself.

        Returns the new blocks (None when ``request`` was preempted), then ``request``'s index
        and the token budget, both adjusted for victims ahead of it in ``running``.
        """
        running = self.running
        while True:
            victim_index = preemption_victim(running, self.policy)
            victim = running.pop(victim_index)
            if victim_index < req_index:
                # Only the priority policy picks a victim ahead of the current request.
                req_index -= 1
                victim_id = victim.request_id
                if victim_id in num_scheduled:  # already scheduled this step: refund it
                    token_budget += num_scheduled.pop(victim_id)
                    scheduled.remove(victim_id)
            self._preempt(victim)
            if victim is request:
                return None, req_index, token_budget
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new)
            if new_blocks is not None:
                return new_blocks, req_index, token_budget

    def _schedule_waiting(
        self, token_budget: int, num_scheduled: dict[str, int]
    ) -> list[NewRequestData]:
        """Admit waiting requests head first while budget, sequence slots and blocks allow."""
        kv = self.kv_cache_manager
        waiting = self.waiting
        admitted: list[NewRequestData] = []
        compiling: list[Request] = []  # grammars not ready: they keep their place in the queue
        while waiting and token_budget > 0 and len(self.running) < self.max_num_running_reqs:
            request = waiting.peek()
            if request.status == _WAITING_FOR_FSM and not self.grammars.ready(request):
                waiting.pop()
                if request.is_finished:  # its grammar failed: an error output is on its way
                    self._free_request(request)
                else:
                    compiling.append(request)
                continue
            hit_blocks: list[KVCacheBlock] = []
            num_hit = 0
            if request.num_computed_tokens == 0:
                hit_blocks, num_hit = kv.get_computed_blocks(request)
            computed = request.num_computed_tokens + num_hit
            # A resumed request recomputes its generated tokens too: they are all in num_tokens.
            num_new = request.num_tokens - computed
            if num_new > token_budget:
                if not self.enable_chunked_prefill:
                    break  # keep order: nothing later jumps ahead of a prompt that does not fit
                num_new = token_budget
            if kv.allocate_slots(request, num_new, num_hit, hit_blocks) is None:
                break
            waiting.pop()
            self.running.append(request)
            request.mark_scheduled()
            if request.num_cached_tokens < 0:  # first admission: report prompt tokens hit
                request.num_cached_tokens = num_hit
            admitted.append(
                NewRequestData(
                    req_id=request.request_id,
                    token_ids=list(request.all_token_ids),
                    sampling_params=request.sampling_params,
                    block_ids=kv.get_block_ids(request.request_id),
                    num_computed_tokens=computed,
                    num_output_tokens=request.num_output_tokens,
                    pooling_params=request.pooling_params,
                )
            )
            num_scheduled[request.request_id] = num_new
            request.num_computed_tokens = computed + num_new
            token_budget -= num_new
        for request in reversed(compiling):
            waiting.prepend(request)
        return admitted

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: drop the request's KV cache and queue it at the head."""
        self.kv_cache_manager.free(request)
        request.mark_preempted()
        request.num_computed_tokens = 0
        self.num_preemptions += 1
        self.waiting.prepend(request)
        self.preempted_req_ids.add(request.request_id)

    # ----------------------------------------------------------------------------- outputs

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        """Append sampled tokens, apply stop rules, free finished requests; outputs per client.

        Only requests with new tokens (or that finished) get an output, so a partial prefill
        emits nothing. Scheduler stats ride on one of the returned EngineCoreOutputs. The
        runner output names the requests; ``scheduler_output`` is the step it answers.
        """
        outputs, stopped = collect_outputs(self.requests, model_runner_output, self.max_model_len)
        if scheduler_output.structured_output_req_ids:
            stopped += self.grammars.advance(
                self.requests, scheduler_output, model_runner_output, outputs
            )
        self.grammars.hand_out_failures(outputs)
        if model_runner_output.pooler_output:  # --runner pooling: vectors, no tokens
            stopped += finish_pooled(self.requests, model_runner_output.pooler_output, outputs)
        if stopped:
            self._remove_stopped(stopped)

        engine_outputs = {
            client: EngineCoreOutputs(outputs=outs) for client, outs in outputs.items()
        }
        if self.log_stats:
            if not engine_outputs:
                engine_outputs[0] = EngineCoreOutputs()
            next(iter(engine_outputs.values())).scheduler_stats = self.make_stats()
        return engine_outputs

    def _remove_stopped(self, stopped: list[Request]) -> None:
        stopped_ids = {r.request_id for r in stopped}
        num_running = len(self.running)
        self.running = [r for r in self.running if r.request_id not in stopped_ids]
        if num_running - len(self.running) != len(stopped):
            # Some were preempted while their tokens were in flight: they sit in `waiting`.
            self.waiting.remove_requests(stopped_ids)
        for request in stopped:
            self._free_request(request)

    # ----------------------------------------------------------------------------- queries

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or bool(self.waiting)

    def has_finished_requests(self) -> bool:
        """True while finished ids wait to be reported to the runner by the next schedule()."""
        return bool(self.finished_req_ids)

    def has_requests(self) -> bool:
        """Whether a step has anything to do (run requests or report finished ones)."""
        return self.has_unfinished_requests() or bool(self.finished_req_ids)

    def get_num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting)

    def get_request_counts(self) -> tuple[int, int]:
        """``(running, waiting)``."""
        return len(self.running), len(self.waiting)

    def make_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            step_counter=self.step_counter,
        )

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget the prefix cache; fails (False) while requests hold blocks.

        With ``reset_running_requests`` every running request is preempted first (in reverse,
        so they return to the waiting queue in their original order).
        """
        if reset_running_requests:
            while self.running:
                self._preempt(self.running.pop())
        return self.kv_cache_manager.reset_prefix_cache()
