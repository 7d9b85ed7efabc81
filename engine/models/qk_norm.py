"""RMSNorm of the queries and keys before RoPE, and OLMoE's clamp of q, k and v.

Qwen3-MoE normalises each head (one ``[head_dim]`` weight shared by the heads); OLMoE the whole
projection (weights ``[q]`` and ``[kv]``), then clamps q, k and v to ``[-clip_qkv, clip_qkv]``
where its config sets it. Both act on the fused q|k|v projection output, between the projection
and the rotary embedding (``LayerProgram``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from corefleet.engine.models.arch import ArchConfig
from corefleet.kernels.backend import KernelBackend

QKVTransform = Callable[[torch.Tensor], torch.Tensor]  # [T, q + 2kv] -> [T, q + 2kv]


class NormWeight(nn.Module):
    """A bare RMSNorm weight (``q_norm.weight``, ``k_norm.weight`` under ``self_attn``)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))


def qk_norm_widths(cfg: ArchConfig) -> tuple[int, int]:
    """The widths of the q and k norm weights: a head, or the whole (this worker's)
    projection."""
    if cfg.qk_norm == "head":
        return cfg.head_dim, cfg.head_dim
    return cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim


def bind_qk_norm(
    cfg: ArchConfig, backend: KernelBackend, q_norm: NormWeight, k_norm: NormWeight
) -> QKVTransform:
    """The transform of the fused q|k|v output, as a closure over the norms' current weights."""
    q_size = cfg.num_attention_heads * cfg.head_dim
    kv_size = cfg.num_key_value_heads * cfg.head_dim
    clip, eps = cfg.clip_qkv, cfg.rms_norm_eps
    width = cfg.head_dim if cfg.qk_norm == "head" else None  # rows normalised head by head
    q_weight, k_weight = q_norm.weight, k_norm.weight

    def norm(part: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # [T, n] -> [T, n]
        rows = part.reshape(-1, width) if width is not None else part  # [T * n / w, w]
        normed, _ = backend.rms_norm(rows.contiguous(), weight, eps, None)
        return normed.reshape(part.shape)

    def transform(qkv: torch.Tensor) -> torch.Tensor:  # [T, q + 2kv]
        q = norm(qkv[:, :q_size], q_weight)
        k = norm(qkv[:, q_size : q_size + kv_size], k_weight)
        out = torch.cat([q, k, qkv[:, q_size + kv_size :]], dim=1)
        return out if clip is None else out.clamp_(-clip, clip)

    return transform
