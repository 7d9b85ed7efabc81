"""A float8 KV cache (``--kv-cache-dtype fp8``) on the Triton backend, under the interpreter:
attention over a float8 cache equals attention over the same values widened to float32, keys
and values reach the cache saturated (an outlier is 448, not NaN) while the query keeps the
activations' dtype, and the backends without float8 kernels refuse the flag clearly."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from corefleet.engine.worker.dtypes import resolve_kv_cache_dtype
from corefleet.kernels import reference
from corefleet.kernels.triton_ops import attention as triton_attention
from corefleet.kernels.triton_ops.backend import TritonBackend
from tests.kernel_cases import (
    assert_close,
    mixed_requests,
    paged_batch,
    poison_unused,
    require_interpreted_kernels,
)

require_interpreted_kernels()

FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize(("num_kv_heads", "group"), [(2, 1), (1, 4)])
def test_attention_over_a_float8_cache_is_attention_over_its_values(
    num_kv_heads: int, group: int
) -> None:
    batch = paged_batch(mixed_requests(16), 16, num_kv_heads, group, 64, torch.float32)
    m, scale = batch.meta, 64**-0.5
    # The reference reads the float8 values widened back to float32 (the new tokens' too).
    key, value, k_cache, v_cache = (
        t.to(FP8).float() for t in (batch.key, batch.value, batch.k_cache, batch.v_cache)
    )
    expected = reference.paged_attention(batch.query, key, value, k_cache, v_cache, m, scale)
    poison_unused(batch)  # NaN outside the requests, kept by the cast: a stray read shows
    fp8 = dataclasses.replace(batch, k_cache=batch.k_cache.to(FP8), v_cache=batch.v_cache.to(FP8))
    assert m.block_tables is not None and m.seq_lens is not None
    assert m.query_start_loc is not None
    actual = triton_attention.unified_attention(
        batch.query,
        fp8.k_cache,
        fp8.v_cache,
        m.block_tables,
        m.seq_lens,
        m.query_start_loc,
        m.max_query_len,
        m.max_seq_len,
        scale,
    )
    assert not torch.isnan(actual).any(), "the kernel read a slot outside its requests"
    assert_close(actual, expected)


def test_keys_and_values_reach_a_float8_cache_saturated_and_the_query_keeps_its_dtype() -> None:
    num_heads, num_kv_heads, head_dim = 4, 2, 16
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(3, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    qkv[1, -1] = 1000.0  # a value outlier beyond float8 e4m3's largest, 448
    cos, sin = torch.ones(3, 1, head_dim), torch.zeros(3, 1, head_dim)  # position 0: no turn
    k_cache = torch.zeros(4, 16, num_kv_heads, head_dim, dtype=FP8)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([5, 17, 40])
    q, k, v = TritonBackend().rotary_to_cache(
        qkv, cos, sin, k_cache, v_cache, slots, num_heads, num_kv_heads
    )
    assert q.dtype == torch.float32 and k.dtype == v.dtype == FP8
    values = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(3, num_kv_heads, head_dim)
    stored = v_cache.view(-1, num_kv_heads, head_dim)[slots].float()
    assert stored[1, -1, -1] == 448.0 and not torch.isnan(stored).any()
    assert torch.equal(stored[0], values[0].to(FP8).float())


@pytest.mark.parametrize("backend", ["cpu", "torch", "flash-attn"])
def test_backends_without_float8_kernels_refuse_fp8_by_name(backend: str) -> None:
    with pytest.raises(ValueError, match=f"fp8 needs the triton attention backend.*{backend}"):
        resolve_kv_cache_dtype("fp8", torch.float32, backend)
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16, "triton") == FP8
