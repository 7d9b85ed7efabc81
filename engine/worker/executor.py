"""Runs the model runner off the engine's main thread so ``step()`` can overlap CPU work.

``UniProcExecutor`` is one device in this process; ``MultiprocExecutor`` (``multiproc_executor``)
keeps the same interface (``execute_model(..., non_block=True)`` returning a future, a failure
callback) over one worker process per device.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol, TypeVar

import torch

from corefleet.engine.config import EngineConfig
from corefleet.engine.core.scheduler_output import (
    GrammarOutput,
    ModelRunnerOutput,
    SchedulerOutput,
)
from corefleet.engine.models.loader import load_arch_config
from corefleet.engine.worker.devices import resolve_device, set_cpu_threads
from corefleet.engine.worker.dtypes import resolve_dtype
from corefleet.engine.worker.dummy_batch import execute_dummy_batch
from corefleet.engine.worker.kv_budget import WorkerMemory, check_explicit_budget
from corefleet.engine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_Arg = TypeVar("_Arg")
_Result = TypeVar("_Result")


class Executor(Protocol):
    """What the engine needs from a model executor (``UniProcExecutor``, ``NullExecutor``)."""

    def register_failure_callback(self, callback: Callable[[str], None]) -> None:
        """Have ``callback`` called (from any thread), with the reason, when the executor
        fails: ``execute_model`` raises, or a worker process dies."""
        ...

    def determine_num_blocks(self) -> int:
        """How many KV-cache blocks (the null block 0 included) fit on the device."""
        ...

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` KV-cache blocks."""
        ...

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> Future[ModelRunnerOutput | None]:
        """Run one step; the future holds its sampled tokens (done on return unless non_block),
        or None when the step has constrained requests: :meth:`sample_tokens` samples it."""
        ...

    def sample_tokens(self, grammar_output: GrammarOutput) -> ModelRunnerOutput:
        """Sample the step ``execute_model`` left waiting, under the grammar's mask."""
        ...

    def execute_dummy_batch(self) -> None:
        """One forward pass that changes no request (an idle rank of an MoE group keeps step
        with its peers' collectives; ``worker/dummy_batch.py``); returns when it is done."""
        ...

    def shutdown(self) -> None:
        """Release the device and any threads; the executor is unusable afterwards."""
        ...


# How the engine builds its executor: an executor class, called with the engine configuration
# and the resolved model path.
ExecutorFactory = Callable[[EngineConfig, str], Executor]


class UniProcExecutor:
    """The model runner on a single background thread."""

    def __init__(self, config: EngineConfig, model_path: str) -> None:
        set_cpu_threads()
        torch.manual_seed(config.model.seed)
        arch = load_arch_config(model_path)
        device = resolve_device(config.device.device)
        dtype = resolve_dtype(config.model.dtype, arch.torch_dtype, device)
        # Read before the weights load; an explicit KV budget beyond it is refused before too.
        memory = WorkerMemory.for_rank(config) if device.type == "cpu" else None
        check_explicit_budget(config, memory)
        # Every torch call runs on this one thread, start-up included: on CPU each calling
        # thread gets its own OpenMP pool, and a second pool spinning idle after start-up
        # would steal a core from every forward pass.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="corefleet-executor")
        self.runner = ModelRunner(config, arch, model_path, device, dtype, memory=memory)
        self._pool.submit(self.runner.load_model).result()
        self._failure_callback: Callable[[str], None] | None = None

    def register_failure_callback(self, callback: Callable[[str], None]) -> None:
        """Called (from the executor thread) when ``execute_model`` raises."""
        self._failure_callback = callback

    def determine_num_blocks(self) -> int:
        return self._pool.submit(self.runner.determine_num_blocks).result()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._pool.submit(self.runner.initialize_kv_cache, num_blocks).result()

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> Future[ModelRunnerOutput | None]:
        future = self._pool.submit(self._run, self.runner.execute_model, scheduler_output)
        if not non_block:
            future.result()
        return future

    def sample_tokens(self, grammar_output: GrammarOutput) -> ModelRunnerOutput:
        return self._pool.submit(self._run, self.runner.sample_tokens, grammar_output).result()

    def execute_dummy_batch(self) -> None:
        self._pool.submit(self._run, execute_dummy_batch, self.runner).result()

    def _run(self, method: Callable[[_Arg], _Result], arg: _Arg) -> _Result:
        try:
            return method(arg)
        except BaseException as exc:
            logger.exception("execute_model failed")
            if self._failure_callback is not None:
                self._failure_callback(f"the model executor failed: {exc!r}")
            raise

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def resolve_executor_class(backend: str) -> ExecutorFactory:
    """``uni``, ``mp`` or an importable ``module:Class`` (see ``ParallelConfig``).

    An imported class is only checked to be a class; it is trusted to implement :class:`Executor`.
    """
    if backend == "uni":
        return UniProcExecutor
    if backend == "mp":
        from corefleet.engine.worker.multiproc_executor import MultiprocExecutor

        return MultiprocExecutor
    module_name, _, class_name = backend.partition(":")
    try:
        module = importlib.import_module(module_name)
        cls = getattr(module, class_name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(
            f"invalid engine argument distributed_executor_backend={backend!r}: cannot import "
            f"it ({exc})"
        ) from exc
    if not isinstance(cls, type):
        raise ValueError(f"distributed_executor_backend={backend!r} is not a class")
    return cls
