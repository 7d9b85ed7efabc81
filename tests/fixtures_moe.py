"""Tiny random mixture-of-experts models written to disk by transformers itself.

``write_tiny_moe`` writes a Hugging Face folder for Mixtral, Qwen2-MoE (with its shared
expert), Qwen3-MoE (q/k norms per head) or OLMoE (q/k norms over the projection), with the
tiny tokenizer of ``fixtures_models``. Every parameter is drawn at random (seeded), routers
included, so tokens spread over the experts and a mix-up between two experts shows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.fixtures_models import EOS_TOKEN, SPECIAL_TOKENS, TINY_VOCAB, write_tiny_tokenizer

MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


def _config(architecture: str, common: dict[str, Any], experts: int, top_k: int) -> Any:
    import transformers

    if architecture == "mixtral":
        return transformers.MixtralConfig(
            **common, intermediate_size=96, num_local_experts=experts, num_experts_per_tok=top_k
        )
    if architecture == "olmoe":
        return transformers.OlmoeConfig(
            **common, intermediate_size=48, num_experts=experts, num_experts_per_tok=top_k
        )
    moe: dict[str, Any] = dict(
        intermediate_size=96,
        moe_intermediate_size=48,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
    )
    if architecture == "qwen2_moe":
        # Layer 1 dense (mlp_only_layers), norm_topk_prob off: both of Qwen's rules in play.
        moe.update(shared_expert_intermediate_size=80, mlp_only_layers=[1], norm_topk_prob=False)
        return transformers.Qwen2MoeConfig(**common, **moe)
    return transformers.Qwen3MoeConfig(**common, **moe, head_dim=16)


def write_tiny_moe(
    path: Path,
    *,
    architecture: str = "qwen3_moe",
    num_experts: int = 8,
    top_k: int = 2,
    num_hidden_layers: int = 2,
    seed: int = 0,
) -> Path:
    """Write a random MoE model of ``architecture`` (``MOE_ARCHITECTURES``) to ``path``.

    hidden 64, 4 heads (head_dim 16), 2 KV heads, ``num_experts`` experts of which each token
    takes ``top_k``; vocab 320 with the tiny tokenizer.
    """
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=50000.0,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=SPECIAL_TOKENS.index(EOS_TOKEN),
        pad_token_id=0,
    )
    config = _config(architecture, common, num_experts, top_k)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    write_tiny_tokenizer(path)
    return path
