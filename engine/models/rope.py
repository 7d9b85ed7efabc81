"""Rotary-embedding tables, with the rope scaling variants Llama-family checkpoints use."""

from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_ROPE_SCALING = ("default", "linear", "llama3")


def rope_type(rope_scaling: dict[str, Any] | None) -> str:
    if not rope_scaling:
        return "default"
    return str(rope_scaling.get("rope_type", rope_scaling.get("type", "default")))


def build_cos_sin_cache(
    head_dim: int, max_positions: int, theta: float, rope_scaling: dict[str, Any] | None
) -> torch.Tensor:  # [max_positions, head_dim] float32: cos | sin
    """cos and sin of every (position, frequency) pair, computed in float32 as HF does."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    )  # [D/2]
    kind = rope_type(rope_scaling)
    if kind == "linear":
        assert rope_scaling is not None
        inv_freq = inv_freq / float(rope_scaling["factor"])
    elif kind == "llama3":
        assert rope_scaling is not None
        inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)
    elif kind != "default":
        raise ValueError(
            f"unsupported rope_scaling type {kind!r}; "
            f"supported: {', '.join(SUPPORTED_ROPE_SCALING)}"
        )
    positions = torch.arange(max_positions, dtype=torch.float32)  # [P]
    freqs = torch.outer(positions, inv_freq)  # [P, D/2]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths are slowed by ``factor``."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)
