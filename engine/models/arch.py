"""The architecture description every model loader produces."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class MoESpec:
    """The sparse MLP of a mixture-of-experts decoder (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE).

    A token's router logits over ``num_experts`` go through a softmax; its ``top_k`` experts
    each run a SwiGLU MLP of ``expert_intermediate_size``, and their outputs are summed weighted
    by those probabilities, renormalised to sum to 1 when ``renormalize`` (Mixtral always,
    the others by ``norm_topk_prob``).
    """

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    renormalize: bool
    # Qwen2-MoE: a dense SwiGLU "shared expert" every token runs, scaled by
    # sigmoid(shared_expert_gate(x)); 0 where the model has none.
    shared_expert_intermediate_size: int = 0
    # Layers whose MLP is dense (``ArchConfig.intermediate_size``): Qwen's mlp_only_layers and
    # decoder_sparse_step.
    dense_layers: tuple[int, ...] = ()

    def is_sparse(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is the experts'."""
        return layer not in self.dense_layers


@dataclass(frozen=True)
class ArchConfig:
    """Shape and numerics of a Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) and
    of the mixture-of-experts decoders built on it (``moe``).

    Loaders fill it from a Hugging Face ``config.json`` or from GGUF metadata.
    """

    architecture: str  # e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    torch_dtype: str | None = None  # the checkpoint's dtype, if stated
    moe: MoESpec | None = None  # None: every layer's MLP is dense
    # RMSNorm of the queries and keys before RoPE: "head" normalises each head (Qwen3-MoE,
    # weight [head_dim]); "projection" the whole projection (OLMoE, weights [q] and [kv]).
    qk_norm: str | None = None
    clip_qkv: float | None = None  # OLMoE: q, k and v clamped to [-clip, clip]

    @property
    def is_moe(self) -> bool:
        """Whether some layer's MLP is a mixture of experts."""
        return self.moe is not None
