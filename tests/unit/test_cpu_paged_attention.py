"""The C++ CPU paged attention (decode rows and prefill chunks as token rows) against the torch
reference (the oracle)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from corefleet.kernels import reference
from corefleet.kernels.backend import KernelBackend
from corefleet.kernels.backend_selection import select_kernel_backend
from corefleet.kernels.cpu import backend as cpu_backend
from corefleet.kernels.metadata import AttentionMetadata, PrefillSpan
from tests.cpu_ops_support import load_cpu_ops_or_skip

load_cpu_ops_or_skip()

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _paged_batch(
    lens: list[int],
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int = 0,
    spare_blocks: int = 3,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random decode rows over a shuffled paged cache.

    Returns query [B, Hq, D], k_cache / v_cache [num_blocks, bs, Hkv, D], block_table
    [B, max_blocks] int64 (ids past a row's last block are 0, the null block) and the
    reference mask [B, 1, 1, max_blocks * bs] bool.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_row = [math.ceil(n / block_size) for n in lens]
    max_blocks = max(blocks_per_row)
    num_blocks = 1 + sum(blocks_per_row) + spare_blocks  # block 0 is the null block
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    k_cache[0] = 0
    v_cache[0] = 0
    # Rows own blocks scattered in random order over the cache, as after much churn.
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    block_table = torch.zeros(len(lens), max_blocks, dtype=torch.int64)  # [B, nb]
    for row, count in enumerate(blocks_per_row):
        block_table[row, :count] = torch.tensor([ids.pop() for _ in range(count)])
    positions = torch.arange(max_blocks * block_size)  # [nb * bs]
    mask = positions[None, :] < torch.tensor(lens)[:, None]  # [B, nb * bs]
    query = torch.randn(len(lens), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    return query, k_cache, v_cache, block_table, mask[:, None, None, :]


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == expected.dtype == dtype
    assert actual.shape == expected.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# bfloat16 multiplies pairs when D % 32 == 0 (32: one 32-wide chunk, 64: two, 128: two tiles)
# and widens otherwise (80).
@pytest.mark.parametrize("head_dim", [32, 64, 80, 128])
# Query groups of 1-4 fit one register tile in pass 2; 5 takes a tile of 4 and one of 1.
@pytest.mark.parametrize("num_kv_heads,group", [(4, 1), (3, 3), (2, 4), (1, 5)])
# Blocks shorter than, equal to and twice the 16-position runs of pass 1.
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_decode_matches_reference(
    dtype: torch.dtype, head_dim: int, num_kv_heads: int, group: int, block_size: int
) -> None:
    # Length 1, partial blocks, exactly full blocks (bs, 2bs) and one row much longer than
    # the rest, all in one batch.
    lens = [1, 5, block_size, 2 * block_size, block_size + 1, 300, 3 * block_size - 1, 2]
    query, k_cache, v_cache, table, mask = _paged_batch(
        lens, block_size, num_kv_heads, group, head_dim, dtype
    )
    scale = head_dim**-0.5
    expected = reference._decode_attention(query, k_cache, v_cache, table, mask, scale)
    actual = cpu_backend.paged_attention(query, k_cache, v_cache, table, torch.tensor(lens), scale)
    _assert_close(actual, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length", [7, 16, 300])
def test_single_row_matches_reference(dtype: torch.dtype, length: int) -> None:
    """One row (single-stream decode): its KV heads are split across the threads."""
    query, k_cache, v_cache, table, mask = _paged_batch([length], 16, 3, 3, 64, dtype, seed=1)
    expected = reference._decode_attention(query, k_cache, v_cache, table, mask, 0.125)
    actual = cpu_backend.paged_attention(
        query, k_cache, v_cache, table, torch.tensor([length]), 0.125
    )
    _assert_close(actual, expected, dtype)


def test_single_token_context_returns_its_value() -> None:
    # With one visible position the softmax weight is exactly 1: the output is that V row.
    query, k_cache, v_cache, table, _ = _paged_batch([1, 1], 16, 2, 3, 64, torch.float32)
    out = cpu_backend.paged_attention(query, k_cache, v_cache, table, torch.tensor([1, 1]), 0.1)
    for row in range(2):
        v_row = v_cache[table[row, 0], 0]  # [Hkv, D]
        torch.testing.assert_close(out[row], v_row.repeat_interleave(3, dim=0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_in_unused_cache_never_reaches_output(dtype: torch.dtype) -> None:
    lens = [1, 7, 16, 33]
    query, k_cache, v_cache, table, mask = _paged_batch(lens, 16, 3, 3, 64, dtype)
    expected = reference._decode_attention(query, k_cache, v_cache, table, mask, 0.125)
    # Poison every slot past each row's length, every block outside the tables and the null
    # block. The reference would propagate these NaNs (0 * NaN); the kernel must never read them.
    used = torch.zeros(k_cache.shape[:2], dtype=torch.bool)  # [num_blocks, bs]
    for row, n in enumerate(lens):
        for pos in range(n):
            used[table[row, pos // 16], pos % 16] = True
    for cache in (k_cache, v_cache):
        cache[~used] = float("nan")
    actual = cpu_backend.paged_attention(query, k_cache, v_cache, table, torch.tensor(lens), 0.125)
    assert not torch.isnan(actual).any()
    _assert_close(actual, expected, dtype)


def test_rejects_length_past_block_table() -> None:
    query, k_cache, v_cache, table, _ = _paged_batch([5, 20], 16, 2, 2, 64, torch.float32)
    with pytest.raises(RuntimeError, match="context_lens"):
        cpu_backend.paged_attention(query, k_cache, v_cache, table, torch.tensor([5, 33]), 1.0)
    with pytest.raises(RuntimeError, match="dtype"):
        cpu_backend.paged_attention(
            query.double(), k_cache, v_cache, table, torch.tensor([5, 20]), 1.0
        )


def test_strided_query_rows() -> None:
    # The model splits q out of a fused qkv projection: rows need not be contiguous.
    lens = [3, 17, 40]
    query, k_cache, v_cache, table, mask = _paged_batch(lens, 16, 3, 3, 64, torch.float32)
    fused = torch.cat([query, torch.randn(3, 6, 64)], dim=1)  # [B, Hq + 6, D]
    strided = fused[:, :9]  # [B, Hq, D] with row stride (Hq + 6) * D
    expected = reference._decode_attention(query, k_cache, v_cache, table, mask, 0.125)
    actual = cpu_backend.paged_attention(
        strided, k_cache, v_cache, table, torch.tensor(lens), 0.125
    )
    _assert_close(actual, expected, torch.float32)


def _mixed_step(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """A step of four decode rows and two prefill spans, the spans' new K/V already written to
    the cache (as the model does before attention). Returns query, key, value, k_cache, v_cache
    and the metadata with every field the model runner fills, token rows included."""
    block_size, num_kv_heads, group, head_dim = 16, 3, 3, 64
    decode_lens = [1, 16, 45, 200]
    # Two prefill spans: one fresh prompt (nothing cached) and one chunk after a cached prefix.
    fresh_len, chunk_len, cached_len = 9, 6, 21
    query_d, k_cache, v_cache, table, mask = _paged_batch(
        decode_lens, block_size, num_kv_heads, group, head_dim, dtype, spare_blocks=8
    )
    gen = torch.Generator().manual_seed(1)
    num_tokens = len(decode_lens) + fresh_len + chunk_len
    num_q_heads = num_kv_heads * group
    query = torch.randn(num_tokens, num_q_heads, head_dim, generator=gen).to(dtype)
    query[: len(decode_lens)] = query_d
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    # The spans' blocks are the cache's last ones: the fresh prompt's one block, then the
    # chunked request's two (cached slots, then its new tokens).
    num_blocks = k_cache.shape[0]
    fresh_block, chunk_blocks = num_blocks - 3, [num_blocks - 2, num_blocks - 1]
    fresh_start, chunk_start = len(decode_lens), len(decode_lens) + fresh_len
    context_len = cached_len + chunk_len
    slots = torch.arange(chunk_blocks[0] * block_size, chunk_blocks[0] * block_size + context_len)
    fresh_slots = torch.arange(fresh_block * block_size, fresh_block * block_size + fresh_len)
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    for span_slots, rows in [
        (slots[cached_len:], slice(chunk_start, chunk_start + chunk_len)),
        (fresh_slots, slice(fresh_start, fresh_start + fresh_len)),
    ]:
        flat_k[span_slots] = key[rows]
        flat_v[span_slots] = value[rows]
    # Token rows: each new token attends to its request's cache up to its own position.
    token_table = torch.zeros(num_tokens, table.shape[1], dtype=torch.int64)
    token_table[: len(decode_lens)] = table
    token_table[fresh_start:chunk_start, 0] = fresh_block
    token_table[chunk_start:, :2] = torch.tensor(chunk_blocks)
    token_lens = torch.cat(
        [
            torch.tensor(decode_lens),
            torch.arange(1, fresh_len + 1),
            torch.arange(cached_len + 1, context_len + 1),
        ]
    )
    meta = AttentionMetadata(
        num_tokens=num_tokens,
        slot_mapping=torch.zeros(num_tokens, dtype=torch.int64),  # unused by attention
        num_decodes=len(decode_lens),
        decode_block_table=table,
        decode_mask=mask,
        decode_context_lens=torch.tensor(decode_lens),
        prefills=[
            PrefillSpan(fresh_start, fresh_len, fresh_len, None),
            PrefillSpan(chunk_start, chunk_len, context_len, slots),
        ],
        token_block_table=token_table,
        token_context_lens=token_lens,
    )
    return query, key, value, k_cache, v_cache, meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# With token rows the kernel takes the whole step in one call; without (metadata built for
# the torch path alone), decode rows go to the kernel and the spans to torch's SDPA.
@pytest.mark.parametrize("token_rows", [True, False])
def test_backend_mixed_decode_and_prefill_matches_reference(
    dtype: torch.dtype, token_rows: bool
) -> None:
    query, key, value, k_cache, v_cache, meta = _mixed_step(dtype)
    if not token_rows:
        meta = dataclasses.replace(meta, token_block_table=None, token_context_lens=None)
    scale = query.shape[-1] ** -0.5
    expected = KernelBackend().paged_attention(query, key, value, k_cache, v_cache, meta, scale)
    backend = cpu_backend.CpuBackend()
    actual = backend.paged_attention(query, key, value, k_cache, v_cache, meta, scale)
    _assert_close(actual, expected, dtype)


def test_selection() -> None:
    cpu = torch.device("cpu")
    assert select_kernel_backend("auto", cpu).name == "cpu"
    assert select_kernel_backend("cpu", cpu).name == "cpu"
    assert select_kernel_backend("torch", cpu).name == "torch"


def test_auto_falls_back_to_torch_when_build_fails(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken() -> None:
        raise RuntimeError("no compiler")

    monkeypatch.setattr(cpu_backend, "load_cpu_ops", broken)
    with caplog.at_level("WARNING"):
        backend = select_kernel_backend("auto", torch.device("cpu"))
    assert backend.name == "torch"
    assert "no compiler" in caplog.text
    with pytest.raises(RuntimeError, match="no compiler"):
        select_kernel_backend("cpu", torch.device("cpu"))
