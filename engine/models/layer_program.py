"""A decoder layer's forward pass as plain calls to kernels bound to its weights.

Why: in a decode step of SmolLM2-135M (30 layers, one token, CPU) the forward pass took 6.6 ms,
of which about 1.7 ms was Python around the ten or so kernel calls of each layer: ``nn.Module``
calls, attribute lookups through ``nn.Module.__getattr__``, and every backend method checking
dtypes and layouts again. So the modules keep what they are good at (parameters under Hugging
Face names, loading, ``.to()``), and the forward pass runs through one ``LayerProgram`` per
layer, built from them once the weights are in place: each linear and norm is a closure over
its tensors with the backend's choice already made (``KernelBackend.bind_*``), the other kernels
are the backend's bound methods. The same kernels get the same arguments, so tokens and logits
are exactly those of calling the backend method by method
(tests/integration/test_layer_program.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from corefleet.kernels.backend import KernelBackend, Linear, Norm
from corefleet.kernels.metadata import AttentionMetadata

# per layer: k, v [num_blocks, bs, Hkv, D], the activations' dtype or --kv-cache-dtype's
KVCache = tuple[torch.Tensor, torch.Tensor]
Rotary = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [T, 1, D]
Reduce = Callable[[torch.Tensor], torch.Tensor]  # the sum over tensor-parallel workers
Mlp = Callable[[torch.Tensor], torch.Tensor]  # [T, H] -> [T, H]


@dataclass(frozen=True, slots=True)
class AttentionShape:
    """Head counts and sizes of one attention layer (grouped-query: heads % kv_heads == 0)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float  # softmax scale, head_dim ** -0.5

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


class LayerProgram:
    """One Llama decoder layer: RMSNorm, attention over the paged cache, RMSNorm, the MLP (dense
    SwiGLU or a mixture of experts), with the residual carried alongside (``__call__``)."""

    __slots__ = (
        "input_norm",
        "mlp",
        "o_proj",
        "paged_attention",
        "post_norm",
        "qk_norm",
        "qkv",
        "reduce",
        "rotary_to_cache",
        "shape",
    )

    def __init__(
        self,
        *,
        input_norm: Norm,
        qkv: Linear,  # [T, H] -> [T, q + 2kv]
        o_proj: Linear,  # [T, q] -> [T, H]
        post_norm: Norm,
        mlp: Mlp,  # [T, H] -> [T, H]: the dense SwiGLU MLP or the experts (``moe``)
        backend: KernelBackend,
        shape: AttentionShape,
        reduce: Reduce | None = None,  # tensor parallelism: after o_proj and the MLP
        qk_norm: Linear | None = None,  # [T, q + 2kv] -> same: q/k norms (Qwen3-MoE, OLMoE)
    ) -> None:
        self.input_norm, self.qkv, self.o_proj = input_norm, qkv, o_proj
        self.post_norm, self.mlp = post_norm, mlp
        self.shape = shape
        self.reduce = reduce
        self.qk_norm = qk_norm
        # Bound once: a method looked up on the backend is a new bound object every call.
        self.rotary_to_cache = backend.rotary_to_cache
        self.paged_attention = backend.paged_attention

    def __call__(
        self,
        hidden: torch.Tensor,  # [T, H]
        residual: torch.Tensor | None,  # [T, H]; None before the first layer
        kv_cache: KVCache,
        meta: AttentionMetadata,
        rotary: Rotary,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # the layer's output, the new residual: [T, H]
        x, residual = self.input_norm(hidden, residual)
        x = self._attention(x, kv_cache, meta, rotary)
        if self.reduce is not None:  # each worker's heads gave a partial o_proj output
            x = self.reduce(x)
        x, residual = self.post_norm(x, residual)
        x = self.mlp(x)
        if self.reduce is not None:
            x = self.reduce(x)
        return x, residual

    def _attention(
        self, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata, rotary: Rotary
    ) -> torch.Tensor:  # [T, H] -> [T, H]
        num_tokens, shape = x.shape[0], self.shape
        k_cache, v_cache = kv_cache
        qkv = self.qkv(x)  # [T, q + 2kv]
        if self.qk_norm is not None:
            qkv = self.qk_norm(qkv)
        # Heads, rotated, in the cache's dtype (a 16-bit cache under float32 activations:
        # attention runs in it, and only its output returns to the activations' dtype).
        q, k, v = self.rotary_to_cache(
            qkv,
            *rotary,
            k_cache,
            v_cache,
            meta.slot_mapping,
            shape.num_heads,
            shape.num_kv_heads,
        )
        out = self.paged_attention(q, k, v, k_cache, v_cache, meta, shape.scale)  # [T, Hq, D]
        return self.o_proj(out.reshape(num_tokens, shape.q_size).to(x.dtype))
