"""The KV cache's size on CPU when ``--kv-cache-memory`` is not given."""

from __future__ import annotations

from corefleet.engine.config import EngineConfig, GiB

DEFAULT_CPU_KV_CACHE_LIMIT = 4 * GiB  # the most the default CPU KV budget takes


def cpu_kv_cache_budget(config: EngineConfig, bytes_per_block: int) -> int:
    """Bytes for the KV cache on CPU: ``--kv-cache-memory`` if given, else what
    ``max_num_seqs`` requests of ``max_model_len`` tokens can fill (plus the reserved block 0),
    at most ``DEFAULT_CPU_KV_CACHE_LIMIT``. Needs the resolved max_model_len."""
    if config.cache.kv_cache_memory is not None:
        return config.cache.kv_cache_memory
    assert config.model.max_model_len is not None, "max_model_len must be resolved"
    blocks_per_request = -(-config.model.max_model_len // config.cache.block_size)
    usable = (config.scheduler.max_num_seqs * blocks_per_request + 1) * bytes_per_block
    return min(usable, DEFAULT_CPU_KV_CACHE_LIMIT)
