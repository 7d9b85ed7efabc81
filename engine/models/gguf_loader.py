"""Reading a llama.cpp GGUF file: architecture metadata and dequantized weights.

Weights come out under Hugging Face Llama names and shapes, so the model code has one naming
scheme whatever the source. Two things differ from a Hugging Face checkpoint beyond the names:

* Every tensor may be quantized (Q4_1, Q8_0, K-quants, ...). ``gguf.quants.dequantize`` turns it
  into float32; we then cast to the requested dtype. GGUF lists dimensions fastest-first (ggml
  order), so the HF shape is the reversed GGUF shape.
* llama.cpp runs Llama with the "normal" (GPT-J style, interleaved pairs) rotary kernel, while HF
  rotates the two halves of each head (NeoX style). Its converter therefore permutes the rows of
  ``q_proj``/``k_proj`` within each head: HF row ``h*d + i*(d/2) + j`` (half ``i``, index ``j``)
  is stored at row ``h*d + 2*j + i``. ``unpermute_rotary`` inverts that. Qwen2 is run with the
  NeoX kernel by llama.cpp and stored unpermuted.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from corefleet.engine.models.arch import ArchConfig

if TYPE_CHECKING:  # torch only for annotations: the coordinator reads models without it
    import torch

# GGUF general.architecture -> the HF architecture our model code implements.
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
# Architectures whose q/k rows llama.cpp permuted for its interleaved rotary kernel.
_PERMUTED_QK = frozenset({"llama"})

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Llama 3.1+ rope scaling is stored as a tensor of per-frequency divisors, not as metadata.
_ROPE_FREQS = "rope_freqs.weight"


def open_gguf(path: str | os.PathLike[str]) -> Any:
    """Open a GGUF file with ``gguf.GGUFReader`` (memory-mapped; nothing is dequantized yet).

    Parsing the header takes seconds for a large vocabulary (every token is a metadata entry),
    and loading a model reads the same file for its architecture, weights and tokenizer, so
    the most recent reader is reused while the file's size and mtime are unchanged.

    Raises:
        ValueError: the file is not a readable GGUF file.
    """
    name = os.path.abspath(os.fspath(path))
    try:
        stat = os.stat(name)
    except OSError as exc:
        raise ValueError(f"{name} is not a readable GGUF file: {exc}") from exc
    return _open_reader(name, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _open_reader(name: str, size: int, mtime_ns: int) -> Any:
    from gguf import GGUFReader  # imported here: only GGUF users pay for it

    try:
        return GGUFReader(name)
    except (ValueError, OSError, IndexError, KeyError) as exc:
        raise ValueError(f"{name} is not a readable GGUF file: {exc}") from exc


def gguf_value(reader: Any, key: str, default: Any = None) -> Any:
    """The decoded value of metadata ``key`` (int, float, bool, str or list), or ``default``."""
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def gguf_architecture(reader: Any, path: str) -> str:
    """``general.architecture``, checked against the architectures corefleet runs.

    Raises:
        ValueError: the architecture is missing or unsupported.
    """
    arch = gguf_value(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: "
            f"{sorted(GGUF_ARCHITECTURES)}"
        )
    return str(arch)


@dataclass(frozen=True)
class GGUFTokenizerMetadata:
    """The ``tokenizer.*`` metadata of a GGUF file (llama.cpp's description of the tokenizer)."""

    model: str | None  # tokenizer.ggml.model: "gpt2" (byte-level BPE), "llama" (SPM), ...
    pre: str | None  # tokenizer.ggml.pre: which pre-tokenizer split the original used
    tokens: list[str]
    merges: list[str]
    token_types: list[int]
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    add_eos: bool
    chat_template: str | None

    def token(self, token_id: int | None) -> str | None:
        """The token string for ``token_id``, or None when absent or out of range."""
        if token_id is None or not 0 <= token_id < len(self.tokens):
            return None
        return self.tokens[token_id]


def read_gguf_tokenizer_metadata(path: str) -> GGUFTokenizerMetadata:
    """Read the tokenizer description stored in a GGUF file.

    Raises:
        ValueError: unreadable file, or no vocabulary in it.
    """
    reader = open_gguf(path)

    def get(key: str) -> Any:
        return gguf_value(reader, f"tokenizer.ggml.{key}")

    tokens = get("tokens")
    if not tokens:
        raise ValueError(f"{path}: the GGUF file has no tokenizer (tokenizer.ggml.tokens)")
    return GGUFTokenizerMetadata(
        model=get("model"),
        pre=get("pre"),
        tokens=list(tokens),
        merges=list(get("merges") or []),
        token_types=[int(t) for t in get("token_type") or []],
        bos_id=get("bos_token_id"),
        eos_id=get("eos_token_id"),
        unk_id=get("unknown_token_id"),
        pad_id=get("padding_token_id"),
        add_bos=bool(get("add_bos_token")),
        add_eos=bool(get("add_eos_token")),
        chat_template=gguf_value(reader, "tokenizer.chat_template"),
    )


def read_gguf_arch_config(path: str) -> ArchConfig:
    """Build an ``ArchConfig`` from the GGUF metadata (and tensor shapes) at ``path``."""
    reader = open_gguf(path)
    arch = gguf_architecture(reader, path)
    tensors = {t.name: t for t in reader.tensors}

    def meta(key: str, default: Any = None) -> Any:
        value = gguf_value(reader, f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"{path}: GGUF metadata {arch}.{key} is missing")
        return value

    hidden = int(meta("embedding_length"))
    heads = int(meta("attention.head_count"))
    kv_heads = meta("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer counts (OpenELM-style) are not a Llama
        raise ValueError(f"{path}: per-layer attention.head_count_kv is not supported")
    head_dim = int(meta("attention.key_length", hidden // heads))
    rope_theta = float(meta("rope.freq_base", 10000.0))
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{path}: no token_embd.weight tensor")
    # The embedding's row count is the vocabulary the weights really have; older files lack
    # {arch}.vocab_size.
    vocab = int(tensors["token_embd.weight"].shape[-1])

    rope_scaling = _rope_scaling(reader, arch, tensors, head_dim, rope_theta, path)
    bos = gguf_value(reader, "tokenizer.ggml.bos_token_id")
    eos_ids: list[int] = []
    # Chat models end turns with an end-of-turn token (Llama 3's <|eot_id|>) that llama.cpp
    # stores apart from EOS; generation must stop on all of them.
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = gguf_value(reader, f"tokenizer.ggml.{key}")
        if value is not None and int(value) not in eos_ids:
            eos_ids.append(int(value))

    return ArchConfig(
        architecture=GGUF_ARCHITECTURES[arch],
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_hidden_layers=int(meta("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(kv_heads),
        head_dim=head_dim,
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=rope_theta,
        max_position_embeddings=int(meta("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        rope_scaling=rope_scaling,
        attention_bias="blk.0.attn_q.bias" in tensors,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(eos_ids),
        # Quantized blocks have no torch dtype; the engine picks one (see ModelConfig.dtype).
        torch_dtype=None,
    )


def _rope_scaling(
    reader: Any, arch: str, tensors: dict[str, Any], head_dim: int, theta: float, path: str
) -> dict[str, Any] | None:
    kind = gguf_value(reader, f"{arch}.rope.scaling.type")
    factor = gguf_value(reader, f"{arch}.rope.scaling.factor")
    original = gguf_value(reader, f"{arch}.rope.scaling.original_context_length")
    if _ROPE_FREQS in tensors:
        freqs = _dequantize(tensors[_ROPE_FREQS]).reshape(-1)
        return _llama3_rope_from_freq_factors(freqs, head_dim, theta, path)
    if kind in (None, "none") or factor in (None, 1.0):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        scaling: dict[str, Any] = {"rope_type": "yarn", "factor": float(factor)}
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling
    raise ValueError(f"{path}: GGUF rope scaling type {kind!r} is not supported")


def llama3_freq_factors(
    head_dim: int,
    theta: float,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position: int,
) -> np.ndarray:
    """The per-frequency divisors Llama 3.1 rope scaling applies (what llama.cpp stores)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = original_max_position / low_freq_factor
    high_wavelen = original_max_position / high_freq_factor
    smooth = (original_max_position / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < high_wavelen, 1.0, np.where(wavelen > low_wavelen, factor, mid))


def _llama3_rope_from_freq_factors(
    freqs: np.ndarray, head_dim: int, theta: float, path: str
) -> dict[str, Any]:
    # GGUF keeps only the resulting divisors; every Llama 3.x release used these band
    # parameters with factor 8 (3.1) or 32 (3.2), so recover them and check the fit.
    factor = float(freqs.max())
    low, high, original = 1.0, 4.0, 8192
    expected = llama3_freq_factors(head_dim, theta, factor, low, high, original)
    if expected.shape != freqs.shape or not np.allclose(expected, freqs, rtol=1e-3):
        raise ValueError(f"{path}: rope_freqs does not match Llama 3 rope scaling; unsupported")
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": original,
    }


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face parameter name for a GGUF tensor name, or None if it has none."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    # blk.{i}.{kind}.{weight|bias}
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def unpermute_rotary(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: interleaved rotary pairs back to split halves.

    ``weight`` is ``[num_heads * head_dim, ...]`` (a weight matrix or a bias vector).
    """
    rows = weight.shape[0]
    rest = weight.shape[1:]
    # Stored row order within a head is (j, half); HF's is (half, j).
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *rest)
        .transpose(1, 2)
        .reshape(rows, *rest)
        .contiguous()
    )


def _dequantize(tensor: Any) -> np.ndarray:
    from gguf.quants import dequantize

    array = dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return np.asarray(array).reshape(shape)


def iter_gguf_weights(path: str, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every weight in the GGUF file, dequantized to ``dtype``.

    The file is opened and its architecture checked now; tensors are dequantized lazily.

    Raises:
        ValueError: unreadable file, unsupported architecture, or (while iterating) a tensor
            with no Llama counterpart.
    """
    reader = open_gguf(path)
    arch = gguf_architecture(reader, path)
    return _generate_gguf_weights(reader, arch, path, dtype)


def _generate_gguf_weights(
    reader: Any, arch: str, path: str, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    heads = int(gguf_value(reader, f"{arch}.attention.head_count"))
    kv_heads = int(gguf_value(reader, f"{arch}.attention.head_count_kv", heads))
    permuted = arch in _PERMUTED_QK
    for tensor in reader.tensors:
        if tensor.name == _ROPE_FREQS:
            continue  # folded into ArchConfig.rope_scaling
        name = hf_name(tensor.name)
        if name is None:
            raise ValueError(f"{path}: GGUF tensor {tensor.name!r} has no Llama counterpart")
        array = _dequantize(tensor)
        if not array.flags.writeable:
            # F32 tensors come back as views of the read-only memory map.
            array = array.copy()
        import torch  # here, not at the top: reading metadata must not need torch

        weight = torch.from_numpy(array)
        if permuted and tensor.name.endswith((".attn_q.weight", ".attn_q.bias")):
            weight = unpermute_rotary(weight, heads)
        elif permuted and tensor.name.endswith((".attn_k.weight", ".attn_k.bias")):
            weight = unpermute_rotary(weight, kv_heads)
        yield name, weight.to(dtype)
