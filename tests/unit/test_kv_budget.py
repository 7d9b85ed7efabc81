"""The CPU KV cache's size (what the batch can fill, the fixed limit, the memory after the
weights; split among a rank's workers; an explicit one refused beyond the memory) and the dtypes:
``--kv-cache-dtype auto`` is the model's dtype, an explicit one is honoured."""

from __future__ import annotations

import pytest
import torch

from corefleet.engine.config import EngineConfig, GiB
from corefleet.engine.worker.dtypes import (
    DtypeChoice,
    choose_dtype,
    choose_kv_cache_dtype,
    describe_dtypes,
    resolve_kv_cache_dtype,
)
from corefleet.engine.worker.kv_budget import (
    DEFAULT_CPU_KV_CACHE_LIMIT,
    WORKING_MARGIN,
    KVBudgetError,
    WorkerMemory,
    check_explicit_budget,
    cpu_kv_cache_budget,
)

BLOCK_BYTES = 1 << 20  # 1 MiB per block of 16 tokens
MiB = 1 << 20


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


def test_default_budget_fits_the_memory_after_weights_and_margin() -> None:
    memory = WorkerMemory(share=3 * GiB, workers=1, source="test")
    budget = cpu_kv_cache_budget(_config(max_num_seqs=256), BLOCK_BYTES, memory, 512 * MiB)
    assert budget == 3 * GiB - 512 * MiB - WORKING_MARGIN
    # A small batch still takes only what it can fill, however much memory there is.
    roomy = WorkerMemory(share=100 * GiB, workers=1, source="test")
    assert cpu_kv_cache_budget(_config(max_num_seqs=8), BLOCK_BYTES, roomy, GiB) == (
        (8 * 128 + 1) * BLOCK_BYTES
    )
    # Nothing left after the weights and the margin: no budget (the runner then refuses).
    tight = WorkerMemory(share=GiB, workers=1, source="test")
    assert cpu_kv_cache_budget(_config(max_num_seqs=256), BLOCK_BYTES, tight, GiB) == 0
    # Memory unknown: the batch and the fixed limit alone.
    unknown = WorkerMemory(share=None, workers=1, source="test")
    assert cpu_kv_cache_budget(_config(), BLOCK_BYTES, unknown) == DEFAULT_CPU_KV_CACHE_LIMIT


def test_workers_split_the_ranks_budget() -> None:
    # Two tensor-parallel workers: each takes half the fixed limit and half an explicit budget,
    # and each its own share less its own weights.
    memory = WorkerMemory(share=40 * GiB, workers=2, source="test")
    config = _config(max_num_seqs=256)
    assert cpu_kv_cache_budget(config, BLOCK_BYTES, memory, GiB) == DEFAULT_CPU_KV_CACHE_LIMIT // 2
    explicit = _config(max_num_seqs=256, kv_cache_memory=6 * GiB)
    assert cpu_kv_cache_budget(explicit, BLOCK_BYTES, memory, GiB) == 3 * GiB


def test_an_explicit_budget_beyond_the_memory_is_refused_naming_the_figures() -> None:
    memory = WorkerMemory(share=4 * GiB, workers=2, source="MemAvailable 8.00 GiB")
    config = _config(kv_cache_memory=10 * GiB)  # 5 GiB per worker, each may use 4
    with pytest.raises(KVBudgetError) as refused:
        check_explicit_budget(config, memory)
    message = str(refused.value)
    assert "--kv-cache-memory 10737418240 (10.00 GiB)" in message
    assert "5.00 GiB for each of its 2 workers" in message
    assert "4.00 GiB for each of its 2 workers (MemAvailable 8.00 GiB)" in message
    assert f"give --kv-cache-memory {8 * GiB} or less" in message
    # After the weights load, they count too: 3.5 GiB per worker fits 4 GiB, not 4 less 1.
    fits_before = _config(kv_cache_memory=7 * GiB)
    check_explicit_budget(fits_before, memory)
    with pytest.raises(KVBudgetError, match=r"1\.00 GiB of it for the weights"):
        cpu_kv_cache_budget(fits_before, BLOCK_BYTES, memory, GiB)
    # Unknown memory: nothing to refuse on.
    check_explicit_budget(config, WorkerMemory(None, 1, "unknown"))


def test_serve_figure_wins_over_reading_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COREFLEET_RANK_MEMORY", str(6 * GiB))
    memory = WorkerMemory.for_rank(EngineConfig.from_kwargs(tensor_parallel_size=3))
    assert memory.share == 2 * GiB and memory.workers == 3
    assert "corefleet serve" in memory.source
    monkeypatch.delenv("COREFLEET_RANK_MEMORY")
    read = WorkerMemory.for_rank(EngineConfig.from_kwargs())
    assert read.share is not None and read.share > 0 and "MemAvailable" in read.source


@pytest.mark.parametrize("value", [0, -1])
def test_kv_cache_memory_must_be_positive(value: int) -> None:
    with pytest.raises(ValueError, match="kv_cache_memory"):
        EngineConfig.from_kwargs(kv_cache_memory=value)


def test_kv_cache_dtype_refuses_unknown_names() -> None:
    with pytest.raises(ValueError, match=r"kv_cache_dtype.*must be one of"):
        EngineConfig.from_kwargs(kv_cache_dtype="fp4")


def test_kv_cache_dtype_resolution() -> None:
    assert resolve_kv_cache_dtype("float16", torch.float32, "cpu") == torch.float16
    assert resolve_kv_cache_dtype("bfloat16", torch.float32, "cpu") == torch.bfloat16
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, "triton") == torch.bfloat16
    assert resolve_kv_cache_dtype("auto", torch.float32, "torch") == torch.float32


@pytest.mark.parametrize("backend", ["cpu", "torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_auto_kv_cache_dtype_is_the_models_on_every_backend(
    backend: str, dtype: torch.dtype
) -> None:
    # vLLM's meaning, whatever the CPU: a float32 model keeps a float32 cache even where the CPU
    # has AVX512-BF16 (it used to get bfloat16 there, and so lost parity with transformers).
    choice = choose_kv_cache_dtype("auto", dtype, backend)
    assert choice.dtype == dtype
    assert choice.why == "--kv-cache-dtype auto: the model's dtype"


def test_dtype_auto_and_explicit() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    for checkpoint in (None, "bfloat16", "float32", "float16"):
        assert choose_dtype("auto", checkpoint, cpu).dtype == torch.float32
    assert choose_dtype("auto", "float16", cuda).dtype == torch.float16
    assert choose_dtype("auto", "bfloat16", cuda).dtype == torch.bfloat16
    assert choose_dtype("auto", "float32", cuda).dtype == torch.bfloat16
    assert choose_dtype("auto", None, cuda).dtype == torch.bfloat16
    # An explicit dtype is honoured on every device.
    for device in (cpu, cuda):
        for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            assert choose_dtype(name, "bfloat16", device) == DtypeChoice(dtype, f"--dtype {name}")


def test_the_log_line_names_both_dtypes_and_why() -> None:
    model = choose_dtype("auto", "bfloat16", torch.device("cpu"))
    line = describe_dtypes(model, choose_kv_cache_dtype("auto", model.dtype, "cpu"))
    assert line == (
        "dtype float32 (--dtype auto on CPU: float32), "
        "KV cache dtype float32 (--kv-cache-dtype auto: the model's dtype)"
    )
    explicit = describe_dtypes(model, choose_kv_cache_dtype("bfloat16", model.dtype, "cpu"))
    assert explicit.endswith("KV cache dtype bfloat16 (--kv-cache-dtype bfloat16)")
