"""Loading Hugging Face-named tensors into a :class:`LlamaForCausalLM`: q/k/v and gate/up fused
as they arrive, GGUF blocks into their quantized layers, a tensor-parallel worker's slices only,
and only the parts a pipeline stage holds (a tied head on a last stage that has no embedding
reads the embedding tensor as its weight). Every tensor's shape is checked, and a model left
with a parameter no tensor filled is refused.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from corefleet.engine.models.moe import (
    SparseMoeBlock,
    expert_block,
    expert_blocks,
    moe_hf_name,
)
from corefleet.engine.models.quant_layers import QuantEmbedding, QuantLinear

if TYPE_CHECKING:
    from corefleet.engine.models.llama import LlamaForCausalLM

_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", "q"),
    "self_attn.k_proj": ("self_attn.qkv_proj", "k"),
    "self_attn.v_proj": ("self_attn.qkv_proj", "v"),
    "mlp.gate_proj": ("mlp.gate_up_proj", "gate"),
    "mlp.up_proj": ("mlp.gate_up_proj", "up"),
    "mlp.shared_expert.gate_proj": ("mlp.shared_expert.gate_up_proj", "gate"),
    "mlp.shared_expert.up_proj": ("mlp.shared_expert.gate_up_proj", "up"),
}
# Mixture-of-experts tensors whose names differ from ours (the experts: ``moe_hf_name``).
_RENAMED = {
    ".mlp.gate.weight": ".mlp.router.weight",
    ".block_sparse_moe.gate.weight": ".mlp.router.weight",
}


def load_llama_weights(
    model: LlamaForCausalLM, weights: Iterable[tuple[str, torch.Tensor]]
) -> None:
    """Copy ``weights`` (Hugging Face names and shapes) into ``model``.

    Raises:
        ValueError: a tensor with no place, of the wrong shape, or a parameter left unfilled.
    """
    tied = model.cfg.tie_word_embeddings
    # A tied head without the embedding beside it (a last pipeline stage) has its own copy.
    head_reads_embedding = (
        tied and model.holds("lm_head.weight") and not model.holds("embed_tokens.weight")
    )
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for hf_name, tensor in weights:
        name, shard = _map_hf_name(hf_name)
        if name == "lm_head.weight" and tied:
            continue
        if name == "embed_tokens.weight" and head_reads_embedding:
            name = "lm_head.weight"
        if not model.holds(name):
            continue  # another pipeline stage's
        if model.shards is not None:
            tensor = model.shards.shard(hf_name, tensor)
        if tensor.dtype == torch.uint8:  # GGUF blocks
            target = _quantized_target(model, name, shard, hf_name)
        elif name not in params:
            raise ValueError(f"checkpoint tensor {hf_name!r} has no place in the model")
        elif shard is None:
            target = params[name].data
        elif ":" in shard:  # one expert's block of a stacked expert parameter
            expert = expert_block(params[name].data, shard, _held_experts(model, name))
            if expert is None:
                continue  # another expert-parallel rank's
            target = expert
        else:
            start, size = _shard_range(model, shard, params[name])
            target = params[name].data.narrow(0, start, size)
        _copy_checked(target, tensor, hf_name)
        loaded.add(f"{name}:{shard}")
    _check_complete(model, loaded, shared_head=tied and not head_reads_embedding)


def _quantized_target(
    model: LlamaForCausalLM, name: str, shard: str | None, hf_name: str
) -> torch.Tensor:
    module = model.get_submodule(name.removesuffix(".weight"))
    if isinstance(module, QuantLinear) and shard in module.shards:
        return module.part_blocks(shard)
    if isinstance(module, QuantEmbedding):
        table: torch.Tensor = module.qweight  # type: ignore[assignment]
        return table
    raise ValueError(f"quantized checkpoint tensor {hf_name!r} has no quantized place")


def _shard_range(model: LlamaForCausalLM, shard: str, param: torch.Tensor) -> tuple[int, int]:
    """Where a part of a fused parameter lies in it (this worker's sizes): gate and up are the
    halves of a gate|up parameter (a layer's MLP or a shared expert, whatever its size)."""
    cfg = model.cfg
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    half = param.shape[0] // 2
    ranges = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv), "gate": (0, half), "up": (half, half)}
    return ranges[shard]


def _check_complete(model: LlamaForCausalLM, loaded: set[str], shared_head: bool) -> None:
    """``shared_head``: the LM head is the embedding table itself (nothing of its own)."""
    expected: set[str] = set()
    for prefix, module in model.named_modules():
        if isinstance(module, QuantLinear) and not (prefix == "lm_head" and shared_head):
            expected.update(f"{prefix}.weight:{shard}" for shard in module.shards)
        elif isinstance(module, QuantEmbedding):
            expected.add(f"{prefix}.weight:None")
    for name, _ in model.named_parameters():
        if name == "lm_head.weight" and shared_head:
            continue
        if name.endswith(("mlp.w13", "mlp.w2")):
            held = _held_experts(model, name)
            expected.update(f"{name}:{block}" for block in expert_blocks(name, held))
        elif name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
            expected.update(f"{name}:{s}" for s in ("q", "k", "v"))
        elif name.endswith("gate_up_proj.weight"):
            expected.update(f"{name}:{s}" for s in ("gate", "up"))
        else:
            expected.add(f"{name}:None")
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")


def _held_experts(model: LlamaForCausalLM, name: str) -> range:
    """The experts the MoE block owning the stacked parameter ``name`` holds."""
    block = model.get_submodule(name.rpartition(".")[0])
    assert isinstance(block, SparseMoeBlock)
    return block.held


def _map_hf_name(hf_name: str) -> tuple[str, str | None]:
    """HF name -> (our parameter name, shard of a fused parameter or None)."""
    expert = moe_hf_name(hf_name)
    if expert is not None:
        return expert[0].removeprefix("model."), expert[1]
    name = hf_name.removeprefix("model.")
    for hf_suffix, ours in _RENAMED.items():
        if name.endswith(hf_suffix):
            return name.removesuffix(hf_suffix) + ours, None
    for hf_part, (ours, shard) in _FUSED.items():
        if f".{hf_part}." in name:
            return name.replace(hf_part, ours), shard
    return name, None


def _copy_checked(target: torch.Tensor, tensor: torch.Tensor, hf_name: str) -> None:
    if tuple(target.shape) != tuple(tensor.shape):
        raise ValueError(
            f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
            f"the model expects {tuple(target.shape)}"
        )
    target.copy_(tensor)
