"""Choosing the Triton and flash-attn backends, and the Triton backend against the torch one."""

from __future__ import annotations

import pytest
import torch

from corefleet.kernels import backend_selection, flash_attn
from corefleet.kernels.backend import KernelBackend
from corefleet.kernels.backend_selection import select_kernel_backend
from corefleet.kernels.triton_ops import support as triton_support
from corefleet.kernels.triton_ops.backend import TritonBackend
from tests.kernel_cases import (
    assert_close,
    mixed_requests,
    paged_batch,
    poison_unused,
    require_interpreted_kernels,
)

require_interpreted_kernels()

CPU = torch.device("cpu")
CUDA = torch.device("cuda")  # only named, never touched: these tests run without a GPU


def test_triton_runs_on_cpu_under_the_interpreter() -> None:
    chosen = select_kernel_backend("triton", CPU)
    assert chosen.name == "triton" and chosen.needs_block_tables


def test_triton_on_cpu_without_the_interpreter_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton_support, "interpreter_enabled", lambda: False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        select_kernel_backend("triton", CPU)


def test_flash_attn_is_refused_with_its_reason() -> None:
    with pytest.raises(ValueError, match="needs a CUDA device"):
        select_kernel_backend("flash-attn", CPU)


def test_flash_attn_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flash_attn, "flash_attn_installed", lambda: True)
    unfit = flash_attn.flash_attn_unfit_reason
    assert unfit(CUDA, torch.bfloat16, 256) is None
    assert unfit(CUDA, torch.float16, 512) is None
    assert "float32" in (unfit(CUDA, torch.float32, 256) or "")
    assert "multiple of 256" in (unfit(CUDA, torch.bfloat16, 16) or "")
    monkeypatch.setattr(flash_attn, "flash_attn_installed", lambda: False)
    assert "not installed" in (unfit(CUDA, torch.bfloat16, 256) or "")


def test_auto_on_cuda_prefers_flash_attn_then_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    best = backend_selection._best_cuda_backend
    monkeypatch.setattr(flash_attn, "flash_attn_installed", lambda: True)
    assert best(CUDA, torch.bfloat16, 256) == "flash-attn"
    assert best(CUDA, torch.bfloat16, 16) == "triton"  # flash-attn 2 pages are >= 256 tokens
    monkeypatch.setattr(flash_attn, "flash_attn_installed", lambda: False)
    assert best(CUDA, torch.bfloat16, 256) == "triton"
    monkeypatch.setattr(triton_support, "triton_installed", lambda: False)
    assert best(CUDA, torch.bfloat16, 16) == "torch"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_equals_reference_backend(dtype: torch.dtype) -> None:
    triton_backend, torch_backend = TritonBackend(), KernelBackend()
    batch = paged_batch(mixed_requests(16), 16, 2, 3, 64, dtype, seed=5)
    expected = torch_backend.paged_attention(
        batch.query, batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta, 0.125
    )
    # The cache write: clear every request's slots, write them back through the backend.
    written_k, written_v = batch.k_cache.clone(), batch.v_cache.clone()
    for cache in (batch.k_cache, batch.v_cache):
        cache.view(-1, *cache.shape[2:])[batch.meta.slot_mapping] = 0
    triton_backend.write_kv_cache(
        batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta.slot_mapping
    )
    assert torch.equal(batch.k_cache, written_k) and torch.equal(batch.v_cache, written_v)
    poison_unused(batch)
    actual = triton_backend.paged_attention(
        batch.query, batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta, 0.125
    )
    assert_close(actual, expected)


def test_paged_attention_without_block_tables_is_an_error() -> None:
    batch = paged_batch([(4, 1)], 16, 1, 1, 64, torch.float32)
    batch.meta.block_tables = None
    with pytest.raises(ValueError, match="needs block_tables"):
        TritonBackend().paged_attention(
            batch.query, batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta, 1.0
        )
