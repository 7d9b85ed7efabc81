"""The KV cache's size on CPU: each worker's part of its rank's budget, from the memory the
rank may use.

The rule (docs/operations.md, "Memory"):

- **Free memory** F: the smaller of the cgroup's headroom and ``MemAvailable``
  (``memory_allowance.py``), read once before any weights load: by ``corefleet serve`` for all
  its local ranks, each of which gets ``F / ranks`` (``COREFLEET_RANK_MEMORY``), else by the
  rank itself. A rank's workers (tensor x pipeline parallel) split its share equally: a worker
  holds only its KV heads and layers, and the rank's memory is one memory.
- **Default budget** of a worker: the smallest of what ``max_num_seqs`` requests of
  ``max_model_len`` tokens can fill in its cache (plus the reserved block 0), its part of
  ``DEFAULT_CPU_KV_CACHE_LIMIT``, and its share less its weights and ``WORKING_MARGIN``.
- **Explicit** ``--kv-cache-memory X``: the rank's KV cache, ``X / workers`` per worker; a
  worker whose part does not fit its share after its weights refuses to start.

The cache is committed as it is written (``kv_allocation.py``), so the budget is what the cache
may grow to under load, not what a rank holds at start.
"""

from __future__ import annotations

from dataclasses import dataclass

from corefleet.engine import envs
from corefleet.engine.config import EngineConfig, GiB
from corefleet.engine.worker.memory_allowance import read_memory_allowance

DEFAULT_CPU_KV_CACHE_LIMIT = 4 * GiB  # the most a rank's default CPU KV budget takes
# What a worker needs besides its weights and its KV cache: the Python process with torch
# (~0.65 GiB resident, most of it torch's libraries), a step's activations and logits (about
# 0.1 GiB for SmolLM2 at 2048 tokens a step, a few hundred MiB for 1-8B models) and the
# allocator's slack.
WORKING_MARGIN = GiB


class KVBudgetError(ValueError):
    """An explicit KV budget this rank cannot hold."""


@dataclass(frozen=True)
class WorkerMemory:
    """What one worker may use: its part of the rank's share of the free memory."""

    share: int | None  # bytes for its weights, KV cache and working memory; None = unknown
    workers: int  # the rank's workers, which split its budget
    source: str  # where the figure comes from, for the log and for refusals

    @classmethod
    def for_rank(cls, config: EngineConfig) -> WorkerMemory:
        """Each worker's part of this rank's memory: ``corefleet serve``'s figure for it if
        given, else what this process may use now (call it before the weights load)."""
        workers = config.parallel.world_size
        given = envs.rank_memory()
        if given is not None:
            source = "its part of the free memory corefleet serve found at start"
            return cls(given // workers, workers, source)
        allowance = read_memory_allowance()
        free = allowance.free
        share = None if free is None else free // workers
        return cls(share, workers, allowance.sources())

    def describe(self) -> str:
        """``"21.86 GiB (MemAvailable 21.86 GiB; cgroup limit none)"``, per worker if several."""
        if self.share is None:
            return f"unknown ({self.source})"
        if self.workers == 1:
            return f"{_gib(self.share)} ({self.source})"
        return f"{_gib(self.share)} for each of its {self.workers} workers ({self.source})"


def _gib(value: int) -> str:
    return f"{value / GiB:.2f} GiB"


def batch_fill_bytes(config: EngineConfig, bytes_per_block: int) -> int:
    """What ``max_num_seqs`` requests of ``max_model_len`` tokens can fill, plus the reserved
    block 0. Needs the resolved max_model_len."""
    assert config.model.max_model_len is not None, "max_model_len must be resolved"
    blocks_per_request = -(-config.model.max_model_len // config.cache.block_size)
    return (config.scheduler.max_num_seqs * blocks_per_request + 1) * bytes_per_block


def check_explicit_budget(
    config: EngineConfig, memory: WorkerMemory | None, weights_bytes: int = 0
) -> None:
    """Refuse an explicit ``--kv-cache-memory`` this worker cannot hold after its weights
    (``weights_bytes``; 0 before they load, for an early refusal)."""
    explicit = config.cache.kv_cache_memory
    if explicit is None or memory is None or memory.share is None:
        return
    part = explicit // memory.workers
    room = memory.share - weights_bytes
    if part <= room:
        return
    each = f" ({_gib(part)} for each of its {memory.workers} workers)" if memory.workers > 1 else ""
    weights = f", {_gib(weights_bytes)} of it for the weights" if weights_bytes else ""
    raise KVBudgetError(
        f"--kv-cache-memory {explicit} ({_gib(explicit)}){each} does not fit: this rank may "
        f"use {memory.describe()}{weights}; give --kv-cache-memory {max(0, room) * memory.workers}"
        " or less, or leave it out to size the KV cache from the memory there is"
    )


def cpu_kv_cache_budget(
    config: EngineConfig,
    bytes_per_block: int,
    memory: WorkerMemory | None = None,
    weights_bytes: int = 0,
) -> int:
    """Bytes of this worker's KV cache on CPU (the rule in the module docstring). Without
    ``memory`` (no model: the null executor) only the batch and the fixed limit count."""
    workers = memory.workers if memory is not None else 1
    if config.cache.kv_cache_memory is not None:
        check_explicit_budget(config, memory, weights_bytes)
        return config.cache.kv_cache_memory // workers
    budget = min(batch_fill_bytes(config, bytes_per_block), DEFAULT_CPU_KV_CACHE_LIMIT // workers)
    if memory is not None and memory.share is not None:
        budget = min(budget, memory.share - weights_bytes - WORKING_MARGIN)
    return max(0, budget)
