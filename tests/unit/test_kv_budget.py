"""The CPU KV cache's default size and dtype: what the batch limits can use, in 16 bits where
the CPU computes in bfloat16."""

from __future__ import annotations

import pytest
import torch

from corefleet.engine.config import EngineConfig, GiB
from corefleet.engine.worker.kv_budget import DEFAULT_CPU_KV_CACHE_LIMIT, cpu_kv_cache_budget
from corefleet.engine.worker.model_runner import resolve_kv_cache_dtype
from corefleet.kernels.cpu.loader import cpu_flags

BLOCK_BYTES = 1 << 20  # 1 MiB per block of 16 tokens


def _config(**kwargs: object) -> EngineConfig:
    return EngineConfig.from_kwargs(**kwargs).with_max_model_len(2048)


def test_default_budget_is_what_the_batch_can_fill() -> None:
    # 8 requests of 2048 tokens: 8 x 128 blocks, plus the reserved block 0.
    assert cpu_kv_cache_budget(_config(max_num_seqs=8), BLOCK_BYTES) == (8 * 128 + 1) * BLOCK_BYTES
    # A partial last block still counts as a block.
    config = EngineConfig.from_kwargs(max_num_seqs=2).with_max_model_len(17)
    assert cpu_kv_cache_budget(config, BLOCK_BYTES) == (2 * 2 + 1) * BLOCK_BYTES


def test_default_budget_is_capped_and_an_explicit_one_wins() -> None:
    assert cpu_kv_cache_budget(_config(max_num_seqs=256), BLOCK_BYTES) == DEFAULT_CPU_KV_CACHE_LIMIT
    explicit = _config(max_num_seqs=8, kv_cache_memory=64 * GiB)
    assert cpu_kv_cache_budget(explicit, BLOCK_BYTES) == 64 * GiB


@pytest.mark.parametrize("value", [0, -1])
def test_kv_cache_memory_must_be_positive(value: int) -> None:
    with pytest.raises(ValueError, match="kv_cache_memory"):
        EngineConfig.from_kwargs(kv_cache_memory=value)


def test_kv_cache_dtype_refuses_unknown_names() -> None:
    with pytest.raises(ValueError, match=r"kv_cache_dtype.*must be one of"):
        EngineConfig.from_kwargs(kv_cache_dtype="fp4")


def test_kv_cache_dtype_resolution() -> None:
    assert resolve_kv_cache_dtype("float16", torch.float32, "cpu") == torch.float16
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, "triton") == torch.bfloat16
    assert resolve_kv_cache_dtype("auto", torch.float32, "torch") == torch.float32
    native_bf16 = "avx512_bf16" in cpu_flags()[0]
    expected = torch.bfloat16 if native_bf16 else torch.float32
    assert resolve_kv_cache_dtype("auto", torch.float32, "cpu") == expected
