"""Random paged-attention batches for kernel tests (CPU interpreter and GPU tiers alike).

A batch is a list of requests ``(num_cached, num_new)``: ``(L - 1, 1)`` is a decode token,
``(0, n)`` a fresh prompt, ``(c, n)`` a prefill chunk after ``c`` cached tokens. The builder
lays their blocks out in shuffled order over a cache with spare blocks, writes every request's
new K/V through the reference, and fills both sets of metadata fields (the reference's gathers
and the kernels' block tables), so one batch feeds the oracle and the kernel under test.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from corefleet.kernels import reference
from corefleet.kernels.metadata import AttentionMetadata, PrefillSpan

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@dataclass
class PagedBatch:
    query: torch.Tensor  # [T, Hq, D]
    key: torch.Tensor  # [T, Hkv, D] the new tokens' keys (already in the cache)
    value: torch.Tensor  # [T, Hkv, D]
    k_cache: torch.Tensor  # [num_blocks, bs, Hkv, D]
    v_cache: torch.Tensor  # [num_blocks, bs, Hkv, D]
    meta: AttentionMetadata
    used: torch.Tensor  # [num_blocks, bs] bool: slots that hold some request's token

    def to(self, device: torch.device) -> PagedBatch:
        m = self.meta
        moved = AttentionMetadata(
            num_tokens=m.num_tokens,
            slot_mapping=m.slot_mapping.to(device),
            num_decodes=m.num_decodes,
            decode_block_table=_opt(m.decode_block_table, device),
            decode_mask=_opt(m.decode_mask, device),
            decode_context_lens=_opt(m.decode_context_lens, device),
            prefills=[
                PrefillSpan(
                    p.token_start, p.num_new_tokens, p.context_len, _opt(p.context_slots, device)
                )
                for p in m.prefills
            ],
            block_tables=_opt(m.block_tables, device),
            seq_lens=_opt(m.seq_lens, device),
            query_start_loc=_opt(m.query_start_loc, device),
            max_query_len=m.max_query_len,
            max_seq_len=m.max_seq_len,
        )
        return PagedBatch(
            self.query.to(device),
            self.key.to(device),
            self.value.to(device),
            self.k_cache.to(device),
            self.v_cache.to(device),
            moved,
            self.used.to(device),
        )


def _opt(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if t is None else t.to(device)


def paged_batch(
    requests: list[tuple[int, int]],  # (num_cached, num_new) per request
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int = 0,
    spare_blocks: int = 3,
) -> PagedBatch:
    """A batch in the engine's order (decode tokens first), its cache and both metadata sets."""
    requests = [r for r in requests if r[1] == 1] + [r for r in requests if r[1] != 1]
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in requests]
    blocks_per_req = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = 1 + sum(blocks_per_req) + spare_blocks  # block 0 is the null block
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    k_cache[0] = 0
    v_cache[0] = 0
    # Requests own blocks scattered in random order over the cache, as after much churn.
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    max_blocks = max(blocks_per_req)
    table = torch.zeros(len(requests), max_blocks, dtype=torch.int64)  # [R, nb]; 0 = unused
    for r, count in enumerate(blocks_per_req):
        table[r, :count] = torch.tensor([ids.pop() for _ in range(count)])
    slots = [
        table[r, torch.arange(s) // block_size] * block_size + torch.arange(s) % block_size
        for r, s in enumerate(seq_lens)
    ]  # per request: [seq_len] slot of each position
    used = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for s in slots:
        used[s] = True

    num_tokens = sum(n for _, n in requests)
    query = torch.randn(num_tokens, num_kv_heads * group, head_dim, generator=gen).to(dtype)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    slot_mapping = torch.cat([s[c:] for s, (c, _) in zip(slots, requests, strict=True)])
    reference.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)

    num_decodes = sum(1 for _, n in requests if n == 1)
    query_lens = torch.tensor([n for _, n in requests])
    query_start_loc = torch.zeros(len(requests) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(query_lens, 0)
    meta = AttentionMetadata(
        num_tokens=num_tokens,
        slot_mapping=slot_mapping,
        num_decodes=num_decodes,
        decode_block_table=table[:num_decodes] if num_decodes else None,
        decode_mask=_decode_mask(seq_lens[:num_decodes], max_blocks * block_size),
        decode_context_lens=torch.tensor(seq_lens[:num_decodes]) if num_decodes else None,
        prefills=[
            PrefillSpan(int(query_start_loc[r]), n, c + n, slots[r] if c else None)
            for r, (c, n) in enumerate(requests)
            if r >= num_decodes
        ],
        block_tables=table.to(torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=query_start_loc,
        max_query_len=int(query_lens.max()),
        max_seq_len=max(seq_lens),
    )
    return PagedBatch(query, key, value, k_cache, v_cache, meta, used.view(num_blocks, block_size))


def _decode_mask(lens: list[int], width: int) -> torch.Tensor | None:
    if not lens:
        return None
    inside = torch.arange(width)[None, :] < torch.tensor(lens)[:, None]  # [Bd, nb * bs]
    return inside[:, None, None, :]


def poison_unused(batch: PagedBatch) -> None:
    """Fill every cache slot no request owns (null block included) with NaN: a kernel that
    reads past a request's tokens or outside its blocks then shows NaN in its output."""
    for cache in (batch.k_cache, batch.v_cache):
        cache[~batch.used] = float("nan")


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal shapes and dtypes, and values within the dtype's tolerance."""
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    tol = TOLERANCE[expected.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


# Mixed batches with empty, partial and full blocks, by block size: decode tokens at lengths 1,
# bs (a full block), bs + 1 (one token in a new block), a long one; fresh prompts (shorter than
# a block, exactly two blocks); chunks after a cached prefix ending mid-block and on a block
# boundary. Block tables are padded with unused (0) blocks for every shorter request.
def mixed_requests(block_size: int) -> list[tuple[int, int]]:
    bs = block_size
    return [
        (0, 1),
        (bs - 1, 1),
        (bs, 1),
        (3 * bs + 4, 1),
        (0, 5),
        (0, 2 * bs),
        (bs + 3, 7),
        (2 * bs, bs + 1),
    ]


def require_interpreted_kernels() -> None:
    """Skip (GPU machine) or fail (CPU machine) unless corefleet's Triton kernels run in the
    interpreter in this process.

    They are compiled instead when something imported them before a ``conftest.py`` set
    ``TRITON_INTERPRET=1``: on a GPU machine ``tests/gpu`` does, when the whole suite runs in
    one process. Without a GPU that can only be a mistake, and silently skipping would hide
    every kernel test.
    """
    from corefleet.kernels.triton_ops import attention as triton_attention
    from corefleet.kernels.triton_ops.support import is_interpreted

    if is_interpreted(triton_attention._unified_attention_kernel):
        return
    why = "corefleet's Triton kernels were imported before TRITON_INTERPRET=1 was set"
    if torch.cuda.is_available():
        pytest.skip(
            f"{why} (tests/gpu ran them natively); run this folder on its own",
            allow_module_level=True,
        )
    raise RuntimeError(f"{why}: they cannot run on this machine without a GPU")
