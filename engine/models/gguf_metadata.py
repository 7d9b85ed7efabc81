"""Reading a llama.cpp GGUF file's metadata: its architecture and its tokenizer.

Nothing here needs torch: the coordinator reads the tokenizer and the architecture of the model
it serves from the same file without loading weights (``gguf_weights`` yields those).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from corefleet.engine.models.arch import ArchConfig
from corefleet.engine.models.gguf_moe import MOE_GGUF_ARCHITECTURES, moe_architecture, moe_fields

# GGUF general.architecture -> the HF architecture our model code implements (a ``llama`` file
# with experts is Mixtral: ``gguf_moe``).
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    **MOE_GGUF_ARCHITECTURES,
}
# Llama 3.1+ rope scaling is stored as a tensor of per-frequency divisors, not as metadata.
ROPE_FREQS_TENSOR = "rope_freqs.weight"


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


def release_gguf_reader() -> None:
    """Drop the cached reader once a process has read what it needs (its architecture, weights
    or tokenizer): a reader holds ~160 MiB of parsed metadata for a 49k-token vocabulary,
    resident for the life of the process otherwise. A later ``open_gguf`` parses again."""
    _open_reader.cache_clear()


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

    def optional(key: str) -> Any:
        return gguf_value(reader, f"{arch}.{key}")

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

    ffn_length, layers = int(meta("feed_forward_length")), int(meta("block_count"))
    architecture = moe_architecture(arch, optional, list(tensors), path)
    moe = (
        {}
        if architecture is None
        else moe_fields(architecture, optional, set(tensors), layers, ffn_length, path)
    )
    return ArchConfig(
        architecture=architecture or GGUF_ARCHITECTURES[arch],
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn_length,
        num_hidden_layers=layers,
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
        **moe,
    )


def _rope_scaling(
    reader: Any, arch: str, tensors: dict[str, Any], head_dim: int, theta: float, path: str
) -> dict[str, Any] | None:
    kind = gguf_value(reader, f"{arch}.rope.scaling.type")
    factor = gguf_value(reader, f"{arch}.rope.scaling.factor")
    original = gguf_value(reader, f"{arch}.rope.scaling.original_context_length")
    if ROPE_FREQS_TENSOR in tensors:
        freqs = dequantize_tensor(tensors[ROPE_FREQS_TENSOR]).reshape(-1)
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


def dequantize_tensor(tensor: Any) -> np.ndarray:
    """A GGUF tensor as float32 numpy, in the Hugging Face (reversed GGUF) shape."""
    from gguf.quants import dequantize

    array = dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return np.asarray(array).reshape(shape)
