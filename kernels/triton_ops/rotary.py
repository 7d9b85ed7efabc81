"""Rotary position embedding in Triton, in place on query and key (``reference.apply_rotary``).

Called by ``TritonBackend.apply_rotary`` once per layer with the step's ``cos``/``sin`` (GPT-NeoX
"rotate half" layout, as Hugging Face's Llama: dimension ``i`` pairs with ``i + D/2`` and both
halves use the same angle). Query and key are fresh projections (views into the fused qkv
output) that nothing else reads, so they are rotated where they lie instead of copied.
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

_INTERPRETER_TOKENS = 128  # tokens per program under the interpreter; one on GPUs


def apply_rotary(
    query: torch.Tensor,  # [T, Hq, D], last dim contiguous (may be a view into qkv)
    key: torch.Tensor,  # [T, Hkv, D], last dim contiguous
    cos: torch.Tensor,  # [T, 1, D] (both halves equal); only [:, 0, :D/2] is read
    sin: torch.Tensor,  # [T, 1, D]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate query and key by their tokens' angles, **in place**; returns them.

    Raises:
        ValueError: mismatched shapes, dtypes or devices, an odd head size, or a strided last
            dimension.
    """
    check_launchable(_rotary_kernel, query, key, cos, sin)
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if key.shape != (num_tokens, num_kv_heads, head_dim) or cos.shape != (num_tokens, 1, head_dim):
        raise ValueError(
            f"query {tuple(query.shape)}, key {tuple(key.shape)} and cos {tuple(cos.shape)} "
            "do not match"
        )
    if head_dim % 2 or sin.shape != cos.shape:
        raise ValueError("rotary needs an even head size and cos/sin of one shape")
    if not query.dtype == key.dtype == cos.dtype == sin.dtype:
        raise ValueError(f"dtypes differ: query {query.dtype}, key {key.dtype}, cos {cos.dtype}")
    if any(t.stride(-1) != 1 for t in (query, key, cos, sin)):
        raise ValueError("query, key, cos and sin need a contiguous last dimension")
    if num_tokens == 0:
        return query, key
    block_t = 1
    if is_interpreted(_rotary_kernel):
        block_t = interpreter_tile(num_tokens, _INTERPRETER_TOKENS)
    _rotary_kernel[(triton.cdiv(num_tokens, block_t),)](
        query,
        key,
        cos,
        sin,
        num_tokens,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        cos.stride(0),
        sin.stride(0),
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        Q_HEADS_PAD=triton.next_power_of_2(num_q_heads),
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HALF=head_dim // 2,
        HALF_PAD=triton.next_power_of_2(head_dim // 2),
        BLOCK_T=block_t,
    )
    return query, key


@triton.jit
def _rotary_kernel(
    q_ptr: tl.tensor,  # [T, Hq, D]
    k_ptr: tl.tensor,  # [T, Hkv, D]
    cos_ptr: tl.tensor,  # [T, 1, D]
    sin_ptr: tl.tensor,  # [T, 1, D]
    num_tokens: int,
    stride_q_tok: int,
    stride_q_head: int,
    stride_k_tok: int,
    stride_k_head: int,
    stride_cos_tok: int,
    stride_sin_tok: int,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,  # head counts rounded up to powers of two for tl.arange
    KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,  # D / 2
    HALF_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,  # tokens per program
) -> None:
    tok = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)  # [BLOCK_T]
    tok_valid = tok < num_tokens
    offs = tl.arange(0, HALF_PAD)  # [HALF_PAD]
    cs_mask = tok_valid[:, None] & (offs < HALF)[None, :]  # [BLOCK_T, HALF_PAD]
    cos = tl.load(cos_ptr + tok[:, None] * stride_cos_tok + offs[None, :], mask=cs_mask, other=0.0)
    sin = tl.load(sin_ptr + tok[:, None] * stride_sin_tok + offs[None, :], mask=cs_mask, other=0.0)
    cos = cos.to(tl.float32)[:, None, :]  # [BLOCK_T, 1, HALF_PAD], shared by every head
    sin = sin.to(tl.float32)[:, None, :]
    _rotate_heads(
        q_ptr,
        tok,
        tok_valid,
        cos,
        sin,
        stride_q_tok,
        stride_q_head,
        NUM_Q_HEADS,
        Q_HEADS_PAD,
        HALF,
        HALF_PAD,
    )
    _rotate_heads(
        k_ptr,
        tok,
        tok_valid,
        cos,
        sin,
        stride_k_tok,
        stride_k_head,
        NUM_KV_HEADS,
        KV_HEADS_PAD,
        HALF,
        HALF_PAD,
    )


@triton.jit
def _rotate_heads(
    x_ptr: tl.tensor,  # [T, H, D]
    tok: tl.tensor,  # [BLOCK_T] int64 token indices
    tok_valid: tl.tensor,  # [BLOCK_T] bool
    cos: tl.tensor,  # [BLOCK_T, 1, HALF_PAD] float32
    sin: tl.tensor,  # [BLOCK_T, 1, HALF_PAD] float32
    stride_tok: int,
    stride_head: int,
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
) -> None:
    heads = tl.arange(0, HEADS_PAD)  # [HEADS_PAD]
    offs = tl.arange(0, HALF_PAD)  # [HALF_PAD]
    first = (
        x_ptr + tok[:, None, None] * stride_tok + heads[None, :, None] * stride_head + offs
    )  # [BLOCK_T, HEADS_PAD, HALF_PAD] pointers to the first half of each head
    mask = (
        tok_valid[:, None, None] & (heads < NUM_HEADS)[None, :, None] & (offs < HALF)[None, None, :]
    )
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    # out = x * cos + rotate_half(x) * sin, with rotate_half(x) = (-x2, x1). Each product is
    # rounded to the input dtype before the sum, as the reference's (and Hugging Face's) three
    # tensor ops do: in bfloat16 the sum can cancel, and matching roundings keep it matching.
    dtype = x1.dtype
    x1_cos = (x1f * cos).to(dtype).to(tl.float32)
    x2_sin = (x2f * sin).to(dtype).to(tl.float32)
    x2_cos = (x2f * cos).to(dtype).to(tl.float32)
    x1_sin = (x1f * sin).to(dtype).to(tl.float32)
    tl.store(first, (x1_cos - x2_sin).to(dtype), mask=mask)
    tl.store(first + HALF, (x2_cos + x1_sin).to(dtype), mask=mask)
