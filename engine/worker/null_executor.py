"""An executor without a model: every step samples one fixed token per request that is due one.

It keeps the scheduler, the KV-cache manager, the busy loop and the sockets exactly as they are
and removes only the forward pass, so benchmarks (``benchmarks/ipc_overhead.py``) measure what
the engine itself costs per step and per request. Select it with
``--distributed-executor-backend corefleet.engine.worker.null_executor:NullExecutor``.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from corefleet.engine.config import EngineConfig
from corefleet.engine.core.scheduler_output import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from corefleet.engine.models.loader import load_arch_config
from corefleet.engine.worker.kv_budget import cpu_kv_cache_budget

if TYPE_CHECKING:
    # Relative on purpose: mypy checks this tree as the package ``engine``, where
    # ``corefleet.engine`` does not resolve (it would make the check below a no-op).
    from .executor import ExecutorFactory

# What the real runner would need per token of KV cache in float32; only sizes the pool.
_BYTES_PER_ELEMENT = 4


class NullExecutor:
    """The executor interface of ``UniProcExecutor`` with a constant-token "model"."""

    def __init__(self, config: EngineConfig, model_path: str) -> None:
        self.config = config
        self.arch = load_arch_config(model_path)
        eos = set(self.arch.eos_token_ids)
        # The smallest id that is not an end-of-sequence token: requests run to max_tokens.
        self.token_id = next(t for t in range(self.arch.vocab_size) if t not in eos)
        self._num_tokens: dict[str, int] = {}  # request id -> tokens it has (prompt + output)
        self._pending: ModelRunnerOutput | None = None  # a step waiting for its grammar mask

    def register_failure_callback(self, callback: Callable[[str], None]) -> None:
        """Part of the interface only: a step without a model never fails."""
        del callback

    def determine_num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_blocks_override is not None:
            return cache.num_blocks_override
        a = self.arch
        per_block = (
            2
            * a.num_hidden_layers
            * cache.block_size
            * a.num_key_value_heads
            * a.head_dim
            * _BYTES_PER_ELEMENT
        )
        return max(2, cpu_kv_cache_budget(self.config, per_block) // per_block)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        del num_blocks  # nothing to allocate

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> Future[ModelRunnerOutput | None]:
        future: Future[ModelRunnerOutput | None] = Future()
        output = self._step(scheduler_output)
        if scheduler_output.structured_output_req_ids:
            self._pending = output  # sampled under the grammar's mask by sample_tokens
            future.set_result(None)
        else:
            future.set_result(output)
        return future

    def sample_tokens(self, grammar_output: GrammarOutput) -> ModelRunnerOutput:
        """A constrained request gets the lowest token its grammar allows, the others the fixed
        token."""
        output, self._pending = self._pending, None
        assert output is not None
        index = {req_id: i for i, req_id in enumerate(output.req_ids)}
        for req_id, banned in zip(grammar_output.req_ids, grammar_output.banned, strict=True):
            output.sampled_token_ids[index[req_id]] = [int(banned.argmin())]
        return output

    def execute_dummy_batch(self) -> None:
        """No model, no forward pass: nothing to keep in step."""

    def _step(self, so: SchedulerOutput) -> ModelRunnerOutput:
        num_tokens = self._num_tokens
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            num_tokens.pop(req_id, None)
        computed: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            num_tokens[new.req_id] = len(new.token_ids)
            computed[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))

        req_ids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for req_id in req_ids:
            done = computed[req_id] + so.num_scheduled_tokens[req_id]
            if done >= num_tokens[req_id]:  # the prompt (or last token) is fully computed
                num_tokens[req_id] += 1
                sampled.append([self.token_id])
            else:
                sampled.append([])  # a prefill chunk: nothing to sample yet
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)

    def shutdown(self) -> None:
        self._num_tokens.clear()


if TYPE_CHECKING:
    # The engine loads this class by name, so nothing else has mypy check that it implements
    # the executor interface.
    _FACTORY: ExecutorFactory = NullExecutor
