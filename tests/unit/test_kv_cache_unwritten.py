"""A KV cache whose unwritten slots hold NaN gives the same attention as one holding zeros.

The CPU cache is committed as it is written (``engine/worker/kv_allocation.py``), and a slot
past a request's context (its last block's tail, the null block padding a shorter row's block
table) holds whatever was there: zero pages, a block's earlier owner, or anything. Every reader
must keep such slots out of its output; a masked NaN is not enough (0 x NaN = NaN). Here every
slot no request owns is NaN, and the outputs must equal, bit for bit, those over the same cache
with zeros there: the torch reference (the ``torch`` backend and every fallback) and the C++
CPU kernel, in both of its call forms (decode rows only, and every token as a row). The Triton
kernels are held to the same in ``tests/unit/triton`` (``poison_unused``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from corefleet.engine.worker.kv_allocation import allocate_kv_cache
from corefleet.kernels.backend import KernelBackend
from corefleet.kernels.cpu.backend import CpuBackend
from corefleet.kernels.metadata import AttentionMetadata
from tests.cpu_ops_support import load_cpu_ops_or_skip
from tests.kernel_cases import PagedBatch, mixed_requests, paged_batch, poison_unused

load_cpu_ops_or_skip()


def _zero_unused(batch: PagedBatch) -> PagedBatch:
    clean = dataclasses.replace(batch, k_cache=batch.k_cache.clone(), v_cache=batch.v_cache.clone())
    for cache in (clean.k_cache, clean.v_cache):
        cache[~clean.used] = 0
    return clean


def _with_token_rows(batch: PagedBatch, requests: list[tuple[int, int]]) -> AttentionMetadata:
    """The C++ kernel's whole-step form: every new token a row over its request's blocks, its
    length its position + 1 (what ``worker/attention_inputs.py`` builds)."""
    tables, lens = [], []
    ordered = [r for r in requests if r[1] == 1] + [r for r in requests if r[1] != 1]
    assert batch.meta.block_tables is not None
    for r, (cached, new) in enumerate(ordered):
        for position in range(cached, cached + new):
            tables.append(batch.meta.block_tables[r].to(torch.int64))
            lens.append(position + 1)
    return dataclasses.replace(
        batch.meta, token_block_table=torch.stack(tables), token_context_lens=torch.tensor(lens)
    )


def _attend(backend: KernelBackend, batch: PagedBatch, meta: AttentionMetadata) -> torch.Tensor:
    scale = batch.query.shape[-1] ** -0.5
    return backend.paged_attention(
        batch.query, batch.key, batch.value, batch.k_cache, batch.v_cache, meta, scale
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("backend_name", ["torch", "cpu", "cpu-token-rows"])
def test_unwritten_nan_slots_change_nothing(
    dtype: torch.dtype, block_size: int, backend_name: str
) -> None:
    requests = mixed_requests(block_size)
    poisoned = paged_batch(requests, block_size, num_kv_heads=2, group=3, head_dim=64, dtype=dtype)
    poison_unused(poisoned)
    assert poisoned.k_cache.isnan().any() and poisoned.v_cache.isnan().any()
    clean = _zero_unused(poisoned)
    backend: KernelBackend = KernelBackend() if backend_name == "torch" else CpuBackend()
    meta = poisoned.meta
    if backend_name == "cpu-token-rows":
        meta = _with_token_rows(poisoned, requests)
    expected = _attend(backend, clean, meta)
    actual = _attend(backend, poisoned, meta)
    assert not actual.isnan().any()
    assert torch.equal(actual, expected)


def test_the_cpu_cache_is_committed_as_written_and_reads_as_zeros() -> None:
    import psutil

    shape = (8192, 16, 4, 64)  # 128 MiB per tensor in float32
    process = psutil.Process()
    before = process.memory_info().rss
    caches = allocate_kv_cache(2, shape, torch.float32, torch.device("cpu"))
    allocated = process.memory_info().rss
    assert len(caches) == 2 and all(t.shape == shape for pair in caches for t in pair)
    assert all(t.is_contiguous() and t.data_ptr() % 4096 == 0 for pair in caches for t in pair)
    # 512 MiB of cache: nothing of it resident before it is written.
    assert allocated - before < 16 << 20
    k_cache = caches[0][0]
    assert not k_cache[:64].any()  # unwritten pages read as zeros
    k_cache[:1024] = 1.0  # 16 MiB written
    written = process.memory_info().rss
    assert 16 << 20 <= written - allocated < 64 << 20
    assert not caches[0][1][:1024].any()  # its neighbour is untouched
