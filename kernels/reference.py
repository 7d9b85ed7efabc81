"""Readable torch implementations: the test oracle for every kernel, and what
``backend.KernelBackend`` (the ``torch`` backend, and every backend's fallback) runs.

KV cache layout (per layer): ``k_cache`` and ``v_cache`` are ``[num_blocks, block_size,
num_kv_heads, head_dim]``; token slot ``s`` lives at block ``s // block_size``, offset
``s % block_size``. Block 0 is reserved and never written by a real request.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from corefleet.kernels.metadata import AttentionMetadata, PrefillSpan


def write_kv_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    """Store each new token's K and V at its cache slot."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hkv, D] the new tokens' keys (already in the cache too)
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    """Causal attention of every new token over its request's cached and new tokens."""
    out = torch.empty_like(query)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    if meta.num_decodes:
        assert meta.decode_block_table is not None
        mask = meta.decode_mask
        if mask is None:  # built here, from the lengths, only for the backend that needs it
            assert meta.decode_context_lens is not None
            width = meta.decode_block_table.shape[1] * k_cache.shape[1]
            positions = torch.arange(width, device=query.device)  # [nb * bs]
            mask = (positions[None, :] < meta.decode_context_lens[:, None])[:, None, None, :]
        out[: meta.num_decodes] = _decode_attention(
            query[: meta.num_decodes], k_cache, v_cache, meta.decode_block_table, mask, scale
        )
    for span in meta.prefills:
        rows = slice(span.token_start, span.token_start + span.num_new_tokens)
        out[rows] = _prefill_attention(
            query[rows], key[rows], value[rows], flat_k, flat_v, span, scale
        )
    return out


def _decode_attention(
    query: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, bs, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, bs, Hkv, D]
    block_table: torch.Tensor,  # [B, nb] int64
    mask: torch.Tensor,  # [B, 1, 1, nb * bs] bool
    scale: float,
) -> torch.Tensor:  # [B, Hq, D]
    batch, num_blocks = block_table.shape
    total_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    num_q_heads = query.shape[1]
    group = num_q_heads // num_kv_heads
    context = num_blocks * block_size
    # index_select over whole blocks is a row memcpy; advanced indexing is slower (the
    # figures are in docs/kernels.md).
    flat_ids = block_table.reshape(-1)
    keys = torch.index_select(k_cache.view(total_blocks, -1), 0, flat_ids)
    values = torch.index_select(v_cache.view(total_blocks, -1), 0, flat_ids)
    # Positions past a row's context (its last block's tail, the null block's padding) hold
    # whatever the cache held: a block's earlier owner, or memory never written. A masked NaN
    # still poisons the row (its score is NaN before the mask, and 0 x NaN = NaN in the V sum),
    # so the gathered copies are zeroed there.
    outside = ~mask.reshape(batch, context, 1)  # [B, L, 1]
    keys = keys.view(batch, context, -1).masked_fill_(outside, 0)
    values = values.view(batch, context, -1).masked_fill_(outside, 0)
    keys = keys.view(batch, context, num_kv_heads, head_dim).transpose(1, 2)  # [B, Hkv, L, D]
    values = values.view(batch, context, num_kv_heads, head_dim).transpose(1, 2)
    # The G query heads sharing a KV head attend as a block of G query rows, so K and V are
    # never repeated per query head; positions past a row's context weigh exactly 0.
    out = F.scaled_dot_product_attention(
        query.view(batch, num_kv_heads, group, head_dim),  # [B, Hkv, G, D]
        keys,
        values,
        attn_mask=mask,
        scale=scale,
    )  # [B, Hkv, G, D]
    return out.reshape(batch, num_q_heads, head_dim)


def _prefill_attention(
    query: torch.Tensor,  # [Tq, Hq, D]
    key: torch.Tensor,  # [Tq, Hkv, D]
    value: torch.Tensor,  # [Tq, Hkv, D]
    flat_k: torch.Tensor,  # [num_slots, Hkv, D]
    flat_v: torch.Tensor,  # [num_slots, Hkv, D]
    span: PrefillSpan,
    scale: float,
) -> torch.Tensor:  # [Tq, Hq, D]
    # 4-D [1, H, T, D] inputs: for 3-D ones torch's CPU SDPA takes its slower unfused math
    # path; with a batch dimension it runs the fused flash kernel, GQA included.
    q = query.transpose(0, 1).unsqueeze(0)  # [1, Hq, Tq, D]
    if span.context_slots is None:
        # Nothing cached before this chunk: plain causal attention over the new tokens.
        k = key.transpose(0, 1).unsqueeze(0)  # [1, Hkv, Tq, D]
        v = value.transpose(0, 1).unsqueeze(0)  # [1, Hkv, Tq, D]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)
    k = flat_k[span.context_slots].transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
    v = flat_v[span.context_slots].transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
    # Query i sits at position (L - Tq + i) and sees keys up to and including that position.
    num_new, context_len = span.num_new_tokens, span.context_len
    q_pos = torch.arange(context_len - num_new, context_len, device=query.device)
    k_pos = torch.arange(context_len, device=query.device)
    mask = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)  # [Tq, L]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)  # [Tq, Hq, D]


def rms_norm(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm, optionally fused with the residual add; returns (normed, new residual).

    Statistics are computed in float32 and the result cast back before the weight multiply,
    as Hugging Face's Llama does, so float32 outputs match it bit for bit.
    """
    if residual is not None:
        x = x + residual
    residual_out = x
    xf = x.float()
    variance = xf.pow(2).mean(-1, keepdim=True)
    normed = (xf * torch.rsqrt(variance + eps)).to(x.dtype)
    return weight * normed, residual_out


def rotary_cos_sin(
    positions: torch.Tensor,  # [T] int64
    cos_sin_cache: torch.Tensor,  # [max_pos, D] float32: cos in [:, :D/2], sin in [:, D/2:]
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin: [T, 1, D] in ``dtype``
    """The rotation of each token's position, computed once per step and shared by every
    layer (GPT-NeoX "rotate half" layout, as HF Llama: both halves use the same angles)."""
    half = cos_sin_cache.shape[1] // 2
    cos_sin = cos_sin_cache.index_select(0, positions)  # [T, D]
    cos = cos_sin[:, :half].repeat(1, 2).unsqueeze(1).to(dtype)  # [T, 1, D]
    sin = cos_sin[:, half:].repeat(1, 2).unsqueeze(1).to(dtype)  # [T, 1, D]
    return cos, sin


def apply_rotary(
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hkv, D]
    cos: torch.Tensor,  # [T, 1, D]
    sin: torch.Tensor,  # [T, 1, D]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate query and key by their positions' angles."""
    return _rotate(query, cos, sin), _rotate(key, cos, sin)


def rotary_embedding(
    positions: torch.Tensor,  # [T] int64
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, D] float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate query and key by their positions: ``rotary_cos_sin`` then ``apply_rotary``."""
    cos, sin = rotary_cos_sin(positions, cos_sin_cache, query.dtype)
    return apply_rotary(query, key, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """SwiGLU activation on a fused gate/up projection: silu(gate) * up."""
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


def fused_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: each expert's gate (rows :I) and up (rows I:) projections
    w2: torch.Tensor,  # [E, H, I]: each expert's down projection
    topk_weights: torch.Tensor,  # [T, K] float32: each token's weight for each chosen expert
    topk_ids: torch.Tensor,  # [T, K] int: the chosen experts; an id outside [0, E) is skipped
) -> torch.Tensor:  # [T, H], x's dtype
    """The experts of a mixture-of-experts layer: ``sum_k w[t, k] * expert_{id[t, k]}(x[t])``
    with each expert a SwiGLU MLP, ``down(silu(gate(x)) * up(x))``.

    The per-expert loop: for each expert, the tokens that chose it, through its MLP, weighted,
    added into the output (in float32). An id outside ``[0, E)`` is skipped, so an expert-
    parallel rank passes the ids of other ranks' experts as -1. Tokens with no expert get 0.
    """
    num_experts = w13.shape[0]
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)  # [T, H]
    for expert in range(num_experts):
        tokens, slots = torch.nonzero(topk_ids == expert, as_tuple=True)  # [n], [n]
        if tokens.numel() == 0:
            continue
        hidden = silu_and_mul(F.linear(x[tokens], w13[expert]))  # [n, I]
        expert_out = F.linear(hidden, w2[expert]).float()  # [n, H]
        weights = topk_weights[tokens, slots].float().unsqueeze(1)  # [n, 1]
        out.index_add_(0, tokens, expert_out * weights)
    return out.to(x.dtype)
