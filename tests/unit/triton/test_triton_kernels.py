"""The Triton kernels against the torch reference (the oracle), on CPU under the interpreter.

The matrix is small on purpose (the interpreter runs every program in numpy, one after
another): head sizes 64 and 128, GQA ratios 1/3/4, block sizes 16 and 32, float32 and
bfloat16, each over one mixed batch of decode tokens and prefill chunks with empty, partial
and full blocks. Every cache slot that no request owns holds NaN while the kernel runs.
"""

from __future__ import annotations

import pytest
import torch

from corefleet.kernels import reference
from corefleet.kernels.triton_ops import activation as triton_activation
from corefleet.kernels.triton_ops import attention as triton_attention
from corefleet.kernels.triton_ops import kv_cache as triton_kv_cache
from corefleet.kernels.triton_ops import rms_norm as triton_rms_norm
from corefleet.kernels.triton_ops import rotary as triton_rotary
from tests.kernel_cases import (
    assert_close,
    mixed_requests,
    paged_batch,
    poison_unused,
    require_interpreted_kernels,
)

require_interpreted_kernels()

DTYPES = [torch.float32, torch.bfloat16]


def _attention(
    batch_requests: list[tuple[int, int]],
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
) -> None:
    batch = paged_batch(batch_requests, block_size, num_kv_heads, group, head_dim, dtype)
    scale = head_dim**-0.5
    m = batch.meta
    expected = reference.paged_attention(
        batch.query, batch.key, batch.value, batch.k_cache, batch.v_cache, m, scale
    )
    poison_unused(batch)
    assert m.block_tables is not None and m.seq_lens is not None
    assert m.query_start_loc is not None
    actual = triton_attention.unified_attention(
        batch.query,
        batch.k_cache,
        batch.v_cache,
        m.block_tables,
        m.seq_lens,
        m.query_start_loc,
        m.max_query_len,
        m.max_seq_len,
        scale,
    )
    assert not torch.isnan(actual).any(), "the kernel read a slot outside its requests"
    assert_close(actual, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("num_kv_heads", "group"), [(2, 1), (2, 3), (1, 4)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_mixed_batch_attention_matches_reference(
    dtype: torch.dtype, head_dim: int, num_kv_heads: int, group: int, block_size: int
) -> None:
    _attention(mixed_requests(block_size), block_size, num_kv_heads, group, head_dim, dtype)


@pytest.mark.parametrize(
    "requests",
    [
        [(0, 1), (5, 1), (16, 1), (40, 1), (95, 1)],  # decode only (one token per program)
        [(0, 70)],  # one fresh prompt longer than a query tile
        [(33, 40), (0, 3)],  # prefill chunks only
        [(300, 1), (2, 1)],  # a long context spanning several key tiles
    ],
    ids=["decode-only", "one-prompt", "chunks-only", "long-context"],
)
def test_batch_shapes(requests: list[tuple[int, int]]) -> None:
    _attention(requests, 16, 2, 3, 64, torch.float32)


def test_tiny_head_and_block_sizes() -> None:
    # The engine allows blocks of 1-256 tokens and the tiny test model has 16-wide heads; the
    # key tile spans several blocks here.
    _attention(mixed_requests(4), 4, 2, 2, 16, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_cache_matches_reference(dtype: torch.dtype) -> None:
    num_tokens, num_kv_heads, head_dim, block_size = 37, 3, 64, 16
    gen = torch.Generator().manual_seed(1)
    # key and value as the model has them: strided views into one fused qkv projection.
    qkv = torch.randn(num_tokens, 5 * num_kv_heads * head_dim, generator=gen).to(dtype)
    kv = qkv[:, 3 * num_kv_heads * head_dim :].view(num_tokens, 2, num_kv_heads, head_dim)
    key, value = kv[:, 0], kv[:, 1]  # [T, Hkv, D] each, row stride 5 * Hkv * D
    slots = torch.randperm(8 * block_size, generator=gen)[:num_tokens] + block_size  # not block 0
    shape = (9, block_size, num_kv_heads, head_dim)
    expected_k, expected_v = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    reference.write_kv_cache(key, value, expected_k, expected_v, slots)
    k_cache, v_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    triton_kv_cache.write_kv_cache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_write_kv_cache_skips_negative_slots() -> None:
    key = torch.ones(3, 2, 16)
    k_cache, v_cache = torch.zeros(4, 4, 2, 16), torch.zeros(4, 4, 2, 16)
    triton_kv_cache.write_kv_cache(key, 2 * key, k_cache, v_cache, torch.tensor([5, -1, 6]))
    assert k_cache.view(-1, 2, 16).sum(dim=(1, 2)).nonzero().flatten().tolist() == [5, 6]
    assert v_cache.view(-1, 2, 16)[6].eq(2).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 576])  # 576: SmolLM2's width, not a power of two
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype: torch.dtype, hidden: int, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(150, hidden, generator=gen).to(dtype)  # > one interpreter tile of rows
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    residual = torch.randn(150, hidden, generator=gen).to(dtype) if with_residual else None
    expected, expected_res = reference.rms_norm(x, weight, 1e-5, residual)
    actual, actual_res = triton_rms_norm.rms_norm(x, weight, 1e-5, residual)
    assert_close(actual, expected)
    # float32: the same additions. bfloat16: the interpreter rounds float32 -> bfloat16 by
    # truncation where GPUs round to nearest even, so the sums agree within one bf16 step.
    assert_close(actual_res, expected_res)
    if dtype == torch.float32:
        assert torch.equal(actual_res, expected_res)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("head_dim", "num_q_heads", "num_kv_heads"), [(64, 9, 3), (128, 4, 1)])
def test_rotary_matches_reference(
    dtype: torch.dtype, head_dim: int, num_q_heads: int, num_kv_heads: int
) -> None:
    num_tokens = 140
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    qkv = qkv.to(dtype)
    q, k, _ = qkv.split(
        [num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1
    )
    q = q.view(num_tokens, num_q_heads, head_dim)  # strided views, as in the model
    k = k.view(num_tokens, num_kv_heads, head_dim)
    cache = torch.randn(512, head_dim, generator=gen)  # any table works: cos | sin halves
    positions = torch.randint(0, 512, (num_tokens,), generator=gen)
    cos, sin = reference.rotary_cos_sin(positions, cache, dtype)
    expected_q, expected_k = reference.apply_rotary(q, k, cos, sin)
    actual_q, actual_k = triton_rotary.apply_rotary(q.clone(), k.clone(), cos, sin)
    # The interpreter rounds float32 -> bfloat16 by truncation (GPUs: to nearest even), and an
    # intermediate product one bf16 step (1/32 below 8) off survives the sum's cancellation.
    atol = 2e-5 if dtype == torch.float32 else 1 / 32
    torch.testing.assert_close(actual_q, expected_q, atol=atol, rtol=2e-2)
    torch.testing.assert_close(actual_k, expected_k, atol=atol, rtol=2e-2)
    # In place: the views into qkv themselves are rotated.
    triton_rotary.apply_rotary(q, k, cos, sin)
    assert torch.equal(q, actual_q) and torch.equal(k, actual_k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_reference(dtype: torch.dtype) -> None:
    x = torch.randn(130, 2 * 1536, generator=torch.Generator().manual_seed(4)).to(dtype)
    assert_close(triton_activation.silu_and_mul(x), reference.silu_and_mul(x))


def test_wrappers_reject_bad_inputs() -> None:
    batch = paged_batch([(3, 1)], 16, 2, 2, 64, torch.float32)
    m = batch.meta
    assert m.block_tables is not None and m.seq_lens is not None
    assert m.query_start_loc is not None
    with pytest.raises(ValueError, match="int32"):
        triton_attention.unified_attention(
            batch.query,
            batch.k_cache,
            batch.v_cache,
            m.block_tables.long(),
            m.seq_lens,
            m.query_start_loc,
            1,
            4,
            1.0,
        )
    with pytest.raises(ValueError, match="dtypes differ"):
        triton_attention.unified_attention(
            batch.query.double(),
            batch.k_cache,
            batch.v_cache,
            m.block_tables,
            m.seq_lens,
            m.query_start_loc,
            1,
            4,
            1.0,
        )
    num_blocks, block_size, num_kv_heads, head_dim = batch.k_cache.shape
    strided = torch.zeros(block_size, num_blocks, num_kv_heads, head_dim).transpose(0, 1)
    with pytest.raises(ValueError, match="contiguous"):
        triton_kv_cache.write_kv_cache(batch.key, batch.value, strided, strided, m.slot_mapping)
    with pytest.raises(ValueError, match="2I"):
        triton_activation.silu_and_mul(torch.zeros(2, 3))
