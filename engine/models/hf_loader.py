"""Reading a local Hugging Face model folder: config.json and safetensors weights.

Only safetensors is read. ``pytorch_model.bin`` files are pickles, which corefleet never loads.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from corefleet.engine.models.arch import ArchConfig, MoESpec

if TYPE_CHECKING:  # torch only for annotations: the coordinator reads models without it
    import torch

HF_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "OlmoeForCausalLM",
)
# Where each architecture's q/k normalisation sits (``ArchConfig.qk_norm``).
_QK_NORM = {"Qwen3MoeForCausalLM": "head", "OlmoeForCausalLM": "projection"}
_INDEX_FILE = "model.safetensors.index.json"


def read_json(path: Path) -> dict[str, Any]:
    """Parse a JSON object file, naming the file when it is malformed."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def read_hf_config(folder: Path) -> dict[str, Any]:
    """config.json of ``folder``, after checking the architecture is one corefleet runs.

    Raises:
        ValueError: no config.json, or an unsupported architecture.
    """
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{folder} has no config.json; it is not a Hugging Face model folder")
    config = read_json(config_path)
    architectures = config.get("architectures") or []
    arch = architectures[0] if architectures else None
    if arch not in HF_ARCHITECTURES:
        raise ValueError(
            f"{folder}: architecture {arch!r} is not supported; supported: {list(HF_ARCHITECTURES)}"
        )
    if config.get("mlp_bias"):
        raise ValueError(f"{folder}: mlp_bias=true is not supported")
    _refuse_quantized(folder, config)
    return config


def _refuse_quantized(folder: Path, config: dict[str, Any]) -> None:
    """Refuse a checkpoint whose weights are quantized (AWQ, GPTQ, FP8, compressed-tensors,
    bitsandbytes, ...) before any tensor is read: their packed tensors would otherwise fail
    mid-load with a message about an unknown weight name that never says why."""
    quantization = config.get("quantization_config")
    if quantization is None:
        return
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    what = method or "quantization_config without a quant_method"
    raise ValueError(
        f"{folder}: its weights are quantized ({what}); corefleet does not load quantized "
        "Hugging Face checkpoints yet. It loads unquantized safetensors (float32, bfloat16, "
        "float16) and GGUF files: use the model's unquantized checkpoint, or a GGUF file of it"
    )


def _token_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    # transformers < 5 writes rope_theta + rope_scaling; transformers 5 writes one
    # rope_parameters dict holding both. Read either.
    params = dict(config.get("rope_parameters") or {})
    theta = float(config.get("rope_theta") or params.pop("rope_theta", None) or 10000.0)
    params.pop("rope_theta", None)
    scaling = dict(config.get("rope_scaling") or params)
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")  # the pre-4.45 spelling
    if scaling.get("rope_type", "default") == "default":
        return theta, None
    return theta, scaling


def read_hf_arch_config(folder: Path) -> ArchConfig:
    """Build an ``ArchConfig`` from ``folder``'s config.json (+ generation_config.json)."""
    config = read_hf_config(folder)
    arch = config["architectures"][0]
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    theta, scaling = _rope(config)

    eos = _token_ids(config.get("eos_token_id"))
    bos = config.get("bos_token_id")
    generation_path = folder / "generation_config.json"
    if generation_path.is_file():
        # Instruct checkpoints often list their end-of-turn token only here (Llama 3).
        generation = read_json(generation_path)
        eos += [i for i in _token_ids(generation.get("eos_token_id")) if i not in eos]
        if bos is None:
            bos = generation.get("bos_token_id")

    return ArchConfig(
        architecture=arch,
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_hidden_layers=int(config["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        rope_scaling=scaling,
        attention_bias=_attention_bias(arch, config),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(eos),
        torch_dtype=config.get("torch_dtype") or config.get("dtype"),
        moe=_moe_spec(arch, config),
        qk_norm=_QK_NORM.get(arch),
        clip_qkv=None if config.get("clip_qkv") is None else float(config["clip_qkv"]),
    )


def _attention_bias(arch: str, config: dict[str, Any]) -> bool:
    if arch == "Qwen2ForCausalLM":
        return True  # Qwen2 always has q/k/v biases and its config does not say so
    if arch == "Qwen2MoeForCausalLM":
        return bool(config.get("qkv_bias", True))
    return bool(config.get("attention_bias", False))


def _moe_spec(arch: str, config: dict[str, Any]) -> MoESpec | None:
    """The experts of a mixture-of-experts architecture, by its config.json's own names."""
    if arch == "MixtralForCausalLM":
        return MoESpec(
            num_experts=int(config["num_local_experts"]),
            top_k=int(config["num_experts_per_tok"]),
            expert_intermediate_size=int(config["intermediate_size"]),
            renormalize=True,
        )
    if arch == "OlmoeForCausalLM":
        return MoESpec(
            num_experts=int(config["num_experts"]),
            top_k=int(config["num_experts_per_tok"]),
            expert_intermediate_size=int(config["intermediate_size"]),
            renormalize=bool(config.get("norm_topk_prob", False)),
        )
    if arch not in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        return None
    # transformers 5 writes Qwen3-MoE's expert count as num_local_experts; the published
    # checkpoints say num_experts.
    experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    layers = int(config["num_hidden_layers"])
    step = int(config.get("decoder_sparse_step") or 1)
    mlp_only = {int(i) for i in config.get("mlp_only_layers") or []}
    dense = tuple(i for i in range(layers) if i in mlp_only or experts == 0 or (i + 1) % step != 0)
    if len(dense) == layers:
        return None  # no sparse layer: a dense model under an MoE name
    return MoESpec(
        num_experts=experts,
        top_k=int(config["num_experts_per_tok"]),
        expert_intermediate_size=int(config["moe_intermediate_size"]),
        renormalize=bool(config.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=int(config.get("shared_expert_intermediate_size") or 0),
        dense_layers=dense,
    )


def safetensors_files(folder: Path) -> list[Path]:
    """The safetensors files holding ``folder``'s weights (sharded or single).

    Raises:
        ValueError: no safetensors weights (a ``.bin``-only checkpoint included).
    """
    index_path = folder / _INDEX_FILE
    if index_path.is_file():
        weight_map = read_json(index_path).get("weight_map") or {}
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index_path} names missing shards: {missing}")
        return files
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    # Mistral repos also carry consolidated.safetensors in Mistral's own naming: skip it.
    files = sorted(p for p in folder.glob("*.safetensors") if not p.name.startswith("consolidated"))
    if not files:
        hint = " (pickle .bin checkpoints are never loaded)" if any(folder.glob("*.bin")) else ""
        raise ValueError(f"{folder} has no .safetensors weights{hint}")
    return files


def iter_hf_weights(folder: Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every weight in ``folder``'s safetensors, cast to ``dtype``.

    Names are already Hugging Face Llama names. Buffers that some old checkpoints saved
    (``rotary_emb.inv_freq``) are dropped, and so is ``lm_head.weight`` of a tied model.
    The folder is checked and its shards listed now; tensors are read lazily.
    """
    config = read_hf_config(folder)
    files = safetensors_files(folder)
    tied = bool(config.get("tie_word_embeddings", False))
    return _generate_hf_weights(files, tied, dtype)


def _generate_hf_weights(
    files: list[Path], tied: bool, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a Mapping
                if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
                    continue
                yield name, handle.get_tensor(name).to(dtype)
