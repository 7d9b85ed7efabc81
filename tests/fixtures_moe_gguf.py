"""Mixture-of-experts GGUF files converted from ``write_tiny_moe`` folders as llama.cpp does.

``write_moe_gguf`` follows llama.cpp's convert_hf_to_gguf.py for Mixtral (architecture
``llama``), Qwen2-MoE (``qwen2moe``), Qwen3-MoE (``qwen3moe``) and OLMoE (``olmoe``): the gguf
package's own writer, key setters and tensor-name map (``gguf.get_tensor_name_map``), each
layer's experts stacked into one 3-D tensor per projection (``torch.stack`` over the experts,
dim 0: ``[E, out, in]``), q/k rows permuted for ``llama`` only (llama.cpp runs the others with
its NeoX rotary), the metadata its converter writes (expert counts and lengths).

Two departures, both on request: ``legacy_experts`` writes a Mixtral file as llama.cpp's
converter did before it stacked experts (one 2-D ``blk.N.ffn_gate.{e}.weight`` per expert), and
a Qwen layer listed in ``mlp_only_layers`` (``write_tiny_moe``'s Qwen2-MoE has one), which
llama.cpp's converter cannot map, is written under the dense FFN names (``blk.N.ffn_gate``...).

``quant`` quantizes tensors by GGUF kind as ``write_tiny_gguf`` does, with the gguf package's
own quantizer; a tensor whose rows are not whole blocks stays float32, as llama.cpp's
converter falls back for such tensors.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from tests.fixtures_models import TINY_CHAT_TEMPLATE, hf_state_dict, llamacpp_permute

# write_tiny_moe's model_type -> the gguf package's architecture.
_ARCH = {"mixtral": "LLAMA", "qwen2_moe": "QWEN2MOE", "qwen3_moe": "QWEN3MOE", "olmoe": "OLMOE"}
_EXPERT = re.compile(
    r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$"
)
# Mixtral's experts, stacked, go by the names its original checkpoints used (as in llama.cpp's
# converter); the others' by the HF module names.
_MIXTRAL_STACKED = "layers.{layer}.feed_forward.experts.{proj}.weight"
_STACKED = "model.layers.{layer}.mlp.experts.{proj}.weight"
_LEGACY_KIND = {"w1": "FFN_GATE", "w3": "FFN_UP", "w2": "FFN_DOWN"}
_DENSE_KIND = {"gate_proj": "FFN_GATE", "up_proj": "FFN_UP", "down_proj": "FFN_DOWN"}


def write_moe_gguf(
    path: Path,
    hf_folder: Path,
    *,
    quant: dict[str, str] | None = None,
    legacy_experts: bool = False,
    extra_metadata: dict[str, int | float] | None = None,
    omit_metadata: tuple[str, ...] = (),
) -> Path:
    """Convert a ``write_tiny_moe`` folder into the GGUF file ``path`` (see the module).

    ``quant`` maps a GGUF tensor kind (``attn_q``, ``ffn_gate_exps``, ``ffn_gate_inp``,
    ``token_embd``, ...) to a quant type the gguf package quantizes (Q8_0, Q4_0, ...);
    ``extra_metadata`` adds keys (without their ``{arch}.`` prefix) with their values (ints
    as uint32, floats as float32); ``omit_metadata`` drops keys the converter wrote.
    """
    import gguf

    config = json.loads((hf_folder / "config.json").read_text())
    model_type = config["model_type"]
    model_arch = getattr(gguf.MODEL_ARCH, _ARCH[model_type])
    arch = gguf.MODEL_ARCH_NAMES[model_arch]
    layers = config["num_hidden_layers"]
    writer = gguf.GGUFWriter(str(path), arch)
    _write_metadata(writer, config, model_type)
    for key, value in (extra_metadata or {}).items():
        add = writer.add_float32 if isinstance(value, float) else writer.add_uint32
        add(f"{arch}.{key}", value)
    for key in omit_metadata:
        del writer.kv_data[0][f"{arch}.{key}"]
    _write_tokenizer(writer, hf_folder, config)

    names = gguf.get_tensor_name_map(model_arch, layers)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, tensor in sorted(hf_state_dict(hf_folder).items()):
        array = tensor.float().numpy()
        if arch == "llama" and ".q_proj." in name:
            array = llamacpp_permute(array, heads)
        elif arch == "llama" and ".k_proj." in name:
            array = llamacpp_permute(array, kv_heads)
        expert = _EXPERT.match(name)
        if expert is not None and not legacy_experts:
            layer, index, proj = int(expert[1]), int(expert[2]), expert[3]
            experts.setdefault((layer, proj), {})[index] = array
            continue
        if expert is not None:  # an old Mixtral file: blk.N.ffn_gate.{e}.weight
            kind = gguf.TENSOR_NAMES[getattr(gguf.MODEL_TENSOR, _LEGACY_KIND[expert[3]])]
            gguf_name = f"{kind.format(bid=expert[1])}.{expert[2]}.weight"
        else:
            gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias")) or _dense(name)
        if gguf_name.endswith("ffn_gate_inp_shexp.weight"):
            array = array.reshape(-1)  # llama.cpp declares it [n_embd]
        _add(writer, gguf_name, array, quant)
    for (layer, proj), by_expert in sorted(experts.items()):
        stacked = np.stack([by_expert[e] for e in sorted(by_expert)])  # [E, out, in]
        template = _MIXTRAL_STACKED if arch == "llama" else _STACKED
        gguf_name = names.get_name(template.format(layer=layer, proj=proj), (".weight",))
        assert gguf_name is not None, (layer, proj)
        _add(writer, gguf_name, stacked, quant)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_metadata(writer: Any, config: dict[str, Any], model_type: str) -> None:
    """The keys llama.cpp's converter writes: its base class's, then each model's own."""
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    # The base class reads num_local_experts (Mixtral; Qwen3-MoE under transformers 5), the
    # Qwen2-MoE and OLMoE classes num_experts.
    writer.add_expert_count(config.get("num_local_experts") or config["num_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    if config.get("head_dim"):
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    if model_type == "mixtral":  # the Llama converter's keys
        writer.add_vocab_size(config["vocab_size"])
        writer.add_rope_dimension_count(config["hidden_size"] // config["num_attention_heads"])
        return
    if "moe_intermediate_size" in config:  # Qwen2-MoE and Qwen3-MoE
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if config.get("shared_expert_intermediate_size") is not None:
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])


def _write_tokenizer(writer: Any, hf_folder: Path, config: dict[str, Any]) -> None:
    """tokenizer.json as llama.cpp's byte-level BPE metadata (special added tokens CONTROL)."""
    tok_json = json.loads((hf_folder / "tokenizer.json").read_text())
    vocab: dict[str, int] = tok_json["model"]["vocab"]
    tokens = [""] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    special = {t["id"] for t in tok_json["added_tokens"] if t["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    writer.add_token_merges(
        [m if isinstance(m, str) else " ".join(m) for m in tok_json["model"]["merges"]]
    )
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(TINY_CHAT_TEMPLATE)


def _dense(hf_name: str) -> str:
    """A dense FFN tensor of a Qwen MoE's ``mlp_only_layers`` layer, by the generic names."""
    import gguf

    match = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.(\w+)\.weight", hf_name)
    if match is None or match[2] not in _DENSE_KIND:
        raise ValueError(f"cannot map tensor {hf_name!r}")  # as llama.cpp's converter says
    kind = gguf.TENSOR_NAMES[getattr(gguf.MODEL_TENSOR, _DENSE_KIND[match[2]])]
    return f"{kind.format(bid=match[1])}.weight"


def _add(writer: Any, gguf_name: str, array: np.ndarray, quant: dict[str, str] | None) -> None:
    import gguf
    from gguf.quants import quantize

    kind = gguf_name.split(".")[-2]
    qtype = gguf.GGMLQuantizationType[quant[kind]] if quant and kind in quant else None
    block = gguf.GGML_QUANT_SIZES[qtype][0] if qtype is not None else 0
    if qtype is not None and array.ndim >= 2 and array.shape[-1] % block == 0:
        blocks = quantize(np.ascontiguousarray(array, dtype=np.float32), qtype)
        writer.add_tensor(gguf_name, blocks, raw_dtype=qtype)
        return
    writer.add_tensor(gguf_name, np.ascontiguousarray(array, dtype=np.float32))


def expert_tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """The GGUF shape (fastest dimension first) of every ``*_exps`` tensor in ``path``."""
    from corefleet.engine.models.gguf_metadata import open_gguf

    reader = open_gguf(path)
    return {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors if "_exps" in t.name}
