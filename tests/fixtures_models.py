"""Tiny random models written to disk, for loader and tokenizer tests.

``write_tiny_llama`` writes a Hugging Face folder (config.json, safetensors, tokenizer.json,
tokenizer_config.json, generation_config.json) with transformers itself, so the files are what
real checkpoints look like. ``write_tiny_gguf`` converts such a folder into a GGUF file the way
llama.cpp's converter does (q/k rows permuted for its interleaved rotary kernel), so the GGUF
path can be checked against known weights. Everything is seeded: same arguments, same bytes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_end|>"
TINY_VOCAB = 320  # 3 special + 256 bytes + merges learned from the corpus below

# Indented block tags and newlines between them exercise trim_blocks/lstrip_blocks.
TINY_CHAT_TEMPLATE = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role: ' + message['role']) }}
    {% endif %}
    {% if loop.first and message['role'] != 'system' %}
<|im_start|>system
You are tiny.<|im_end|>
    {% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] | trim }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

_CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b  # 123 456 7890",
    "Unicode: café naïve 😀 🚀 你好 世界 こんにちは Привет",
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>",
    "    indented    text\twith\ttabs\n\n\nand newlines",
] * 20


def train_tiny_tokenizer(vocab_size: int = TINY_VOCAB) -> Any:
    """A byte-level BPE (GPT-2 style) trained on a small fixed corpus; special tokens 0..2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    return tok


def write_tiny_tokenizer(
    path: Path,
    *,
    add_bos_token: bool | None = None,
    chat_template_file: bool = False,
) -> None:
    """Write tokenizer.json + tokenizer_config.json (and maybe chat_template.jinja) to path.

    ``add_bos_token=None`` leaves the flag out of tokenizer_config.json; ``chat_template_file``
    stores the template in chat_template.jinja instead of the config (newer transformers).
    """
    path.mkdir(parents=True, exist_ok=True)
    train_tiny_tokenizer().save(str(path / "tokenizer.json"))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 256,
    }
    if add_bos_token is not None:
        config["add_bos_token"] = add_bos_token
    if chat_template_file:
        (path / "chat_template.jinja").write_text(TINY_CHAT_TEMPLATE, encoding="utf-8")
    else:
        config["chat_template"] = TINY_CHAT_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")


def write_tiny_model(
    path: Path,
    *,
    architecture: str = "llama",
    tie_word_embeddings: bool = False,
    num_kv_heads: int = 2,
    seed: int = 0,
    max_shard_size: str | None = None,
    add_bos_token: bool | None = None,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_hidden_layers: int = 2,
) -> Path:
    """Write a random ``llama``, ``mistral`` or ``qwen2`` model (2 layers unless told) in HF
    format to path.

    hidden 64, 4 heads (head_dim 16), ``num_kv_heads`` KV heads, intermediate 128, vocab 320
    (hidden and intermediate can be raised: GGUF K-quants need multiples of 256).
    Every parameter (norms and biases too) is drawn at random so that any two tensors differ
    and a mix-up between them shows. ``max_shard_size`` (e.g. "100KB") writes shards and an
    index.
    """
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[architecture]
    config = config_cls(
        vocab_size=TINY_VOCAB,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=50000.0,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=SPECIAL_TOKENS.index(BOS_TOKEN),
        eos_token_id=SPECIAL_TOKENS.index(EOS_TOKEN),
    )
    torch.manual_seed(seed)
    model = model_cls(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    path.mkdir(parents=True, exist_ok=True)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    write_tiny_tokenizer(path, add_bos_token=add_bos_token)
    return path


def write_tiny_llama(
    path: Path,
    *,
    tie_word_embeddings: bool = False,
    num_kv_heads: int = 2,
    seed: int = 0,
    **kwargs: Any,
) -> Path:
    """Write a random tiny Llama with GQA (4 heads, ``num_kv_heads`` KV heads) to path."""
    return write_tiny_model(
        path,
        architecture="llama",
        tie_word_embeddings=tie_word_embeddings,
        num_kv_heads=num_kv_heads,
        seed=seed,
        **kwargs,
    )


def hf_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor in a folder's safetensors files, as saved."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def llamacpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter permutation of HF q/k rows (split halves -> interleaved pairs)."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


_GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf: str) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in top:
        return top[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GGUF_LAYER[module]}.{kind}"


def write_tiny_gguf(
    path: Path,
    hf_folder: Path,
    *,
    arch: str = "llama",
    pre: str = "gpt-2",
    add_bos_token: bool = False,
    float16: bool = False,
    rope_freqs: np.ndarray | None = None,
    quant: dict[str, str] | None = None,
) -> Path:
    """Convert a tiny HF folder (from ``write_tiny_model``) into the GGUF file ``path``.

    Like llama.cpp: ggml dimension order, q/k permuted for ``llama``, tokenizer metadata from
    tokenizer.json (special added tokens become CONTROL), no ``output.weight`` when tied.
    ``float16`` stores matrices as F16 (norms stay F32); ``rope_freqs`` adds that tensor.
    ``quant`` maps a GGUF tensor kind (``attn_q``, ``ffn_down``, ``token_embd``, ``output``)
    to a quant type name: the gguf package quantizes the weight where it can (Q8_0, Q4_0,
    Q4_1, Q5_0, ...); for the types it cannot (K-quants) the tensor becomes random valid
    blocks of that type (``gguf_blocks.random_qweight``), no longer the folder's weight.
    """
    import gguf

    config = json.loads((hf_folder / "config.json").read_text())
    tok_json = json.loads((hf_folder / "tokenizer.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_dimension_count(config.get("head_dim") or config["hidden_size"] // heads)
    writer.add_vocab_size(config["vocab_size"])

    vocab: dict[str, int] = tok_json["model"]["vocab"]
    tokens = [""] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    special = {t["id"] for t in tok_json["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok_json["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_add_bos_token(add_bos_token)
    writer.add_chat_template(TINY_CHAT_TEMPLATE)

    for name, tensor in sorted(hf_state_dict(hf_folder).items()):
        array = tensor.float().numpy()
        if arch == "llama" and ".q_proj." in name:
            array = llamacpp_permute(array, heads)
        elif arch == "llama" and ".k_proj." in name:
            array = llamacpp_permute(array, kv_heads)
        gguf_name = _gguf_name(name)
        kind = gguf_name.split(".")[-2]
        if quant and kind in quant and array.ndim == 2:
            blocks, qtype = _quantized(array, quant[kind], seed=len(gguf_name))
            writer.add_tensor(gguf_name, blocks, raw_dtype=qtype)
            continue
        if float16 and array.ndim == 2:
            array = array.astype(np.float16)
        writer.add_tensor(gguf_name, np.ascontiguousarray(array))
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _quantized(array: np.ndarray, type_name: str, seed: int) -> tuple[np.ndarray, Any]:
    """``array`` ``[N, K]`` in GGUF quant type ``type_name``: ``(uint8 blocks, ggml type)``."""
    import gguf
    from gguf.quants import quantize

    from corefleet.kernels.gguf_quant import FORMATS_BY_NAME
    from tests.gguf_blocks import random_qweight

    qtype = gguf.GGMLQuantizationType[type_name]
    try:
        return quantize(np.ascontiguousarray(array, dtype=np.float32), qtype), qtype
    except NotImplementedError:
        fmt = FORMATS_BY_NAME[type_name]
        return random_qweight(fmt, array.shape[0], array.shape[1], seed=seed, scale=0.1), qtype
