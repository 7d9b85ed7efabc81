"""Write the step's new K/V into the paged cache in Triton (``reference.write_kv_cache``).

Called by ``TritonBackend.write_kv_cache`` once per layer, before attention. Each token's
``Hkv * D`` values are one contiguous row of the cache at its slot (``[num_blocks * bs, Hkv * D]``
when the cache is contiguous), so the kernel is a row scatter: a tile of tokens by a tile of
that row, K and V together.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from corefleet.kernels.triton_ops.support import (
    check_launchable,
    interpreter_tile,
    is_interpreted,
)

_GPU_TOKENS = 8
_GPU_ROW_TILE = 1024  # elements of one token's Hkv * D row per program
_INTERPRETER_TOKENS = 256


def write_kv_cache(
    key: torch.Tensor,  # [T, Hkv, D], may be a strided view into the fused qkv projection
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] contiguous
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] contiguous
    slot_mapping: torch.Tensor,  # [T] int64: flat slot (block * block_size + offset); < 0 skips
) -> None:
    """Store each new token's K and V at its cache slot.

    Raises:
        ValueError: mismatched shapes, dtypes or devices, or a non-contiguous cache.
    """
    check_launchable(_write_kv_cache_kernel, key, value, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape or k_cache.shape[2:] != key.shape[1:]:
        raise ValueError(
            f"key {tuple(key.shape)} / value {tuple(value.shape)} do not fit the cache "
            f"{tuple(k_cache.shape)}"
        )
    if k_cache.shape != v_cache.shape or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous and of one shape")
    if not key.dtype == value.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError(f"dtypes differ: key {key.dtype}, cache {k_cache.dtype}")
    if key.stride(2) != 1 or value.stride(2) != 1:
        raise ValueError("key and value need a contiguous last dimension")
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (num_tokens,):
        raise ValueError("slot_mapping must be int64 [T]")
    if num_tokens == 0:
        return
    row = num_kv_heads * head_dim
    if is_interpreted(_write_kv_cache_kernel):
        block_t = interpreter_tile(num_tokens, _INTERPRETER_TOKENS)
        row_tile = triton.next_power_of_2(row)
    else:
        block_t, row_tile = _GPU_TOKENS, min(_GPU_ROW_TILE, triton.next_power_of_2(row))
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(row, row_tile))
    _write_kv_cache_kernel[grid](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        num_tokens,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        HEAD_DIM=head_dim,
        ROW=row,
        BLOCK_T=block_t,
        ROW_TILE=row_tile,
    )


@triton.jit
def _write_kv_cache_kernel(
    key_ptr: tl.tensor,  # [T, Hkv, D]
    value_ptr: tl.tensor,  # [T, Hkv, D]
    k_cache_ptr: tl.tensor,  # [num_slots, Hkv * D] (the contiguous cache, flattened)
    v_cache_ptr: tl.tensor,  # [num_slots, Hkv * D]
    slot_mapping_ptr: tl.tensor,  # [T] int64
    num_tokens: int,
    stride_k_tok: int,
    stride_k_head: int,
    stride_v_tok: int,
    stride_v_head: int,
    HEAD_DIM: tl.constexpr,
    ROW: tl.constexpr,  # Hkv * D: elements per token and cache slot
    BLOCK_T: tl.constexpr,  # tokens per program
    ROW_TILE: tl.constexpr,  # elements of the row per program (a power of two)
) -> None:
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    offs_r = tl.program_id(1) * ROW_TILE + tl.arange(0, ROW_TILE)  # [ROW_TILE]
    slot = tl.load(slot_mapping_ptr + offs_t, mask=offs_t < num_tokens, other=-1)  # [BLOCK_T]
    # Negative slots mark tokens with no cache place (padding); they and the tile's tail past
    # the last token or the row's end are masked out.
    mask = (slot >= 0)[:, None] & (offs_r < ROW)[None, :]  # [BLOCK_T, ROW_TILE]
    head = offs_r // HEAD_DIM  # [ROW_TILE]
    dim = offs_r % HEAD_DIM  # [ROW_TILE]
    tok = offs_t.to(tl.int64)[:, None]  # [BLOCK_T, 1]
    src_k = key_ptr + tok * stride_k_tok + (head * stride_k_head + dim)[None, :]
    src_v = value_ptr + tok * stride_v_tok + (head * stride_v_head + dim)[None, :]
    dst = slot[:, None] * ROW + offs_r[None, :]  # [BLOCK_T, ROW_TILE] int64 offsets
    tl.store(k_cache_ptr + dst, tl.load(src_k, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst, tl.load(src_v, mask=mask), mask=mask)
