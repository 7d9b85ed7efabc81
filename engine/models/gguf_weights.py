"""Dequantized weights from a llama.cpp GGUF file, under Hugging Face Llama names and shapes.

The model code has one naming scheme whatever the source. Two things differ from a Hugging Face
checkpoint beyond the names:

* Every tensor may be quantized (Q4_1, Q8_0, K-quants, ...). With ``keep_quantized`` the weights
  in a format the kernels read (``corefleet.kernels.gguf_quant``) come out as their raw blocks,
  ``uint8 [N, row_bytes]``, read from the file straight into memory the model owns (no page of
  the file's mapping is touched, so it does not stay resident); every other tensor is
  dequantized by ``gguf.quants.dequantize`` to float32 and cast to the requested dtype. GGUF
  lists dimensions fastest-first (ggml order), so the HF shape is the reversed GGUF shape.
* llama.cpp runs Llama with the "normal" (GPT-J style, interleaved pairs) rotary kernel, while HF
  rotates the two halves of each head (NeoX style). Its converter therefore permutes the rows of
  ``q_proj``/``k_proj`` within each head: HF row ``h*d + i*(d/2) + j`` (half ``i``, index ``j``)
  is stored at row ``h*d + 2*j + i``. ``unpermute_rotary`` inverts that. Qwen2 is run with the
  NeoX kernel by llama.cpp and stored unpermuted; so are Qwen2-MoE, Qwen3-MoE and OLMoE, while
  Mixtral (a ``llama`` file with experts) is permuted like Llama (``gguf_moe``).

Mixture-of-experts files store each layer's experts stacked in one 3-D tensor
(``blk.N.ffn_gate_exps``, ...): they come out as one HF tensor per expert and projection
(``model.layers.N.mlp.experts.{e}.gate_proj.weight``), always dequantized, since the quantized
kernels take 2-D weights only; routers and the shared expert's gate are dequantized too
(``gguf_moe.keeps_float``). A shared expert's gate stored 1-D comes out ``[1, H]``.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch

from corefleet.engine.models.gguf_metadata import (
    ROPE_FREQS_TENSOR,
    dequantize_tensor,
    gguf_architecture,
    gguf_value,
    open_gguf,
)
from corefleet.engine.models.gguf_moe import (
    SHARED_EXPERT_GATE,
    keeps_float,
    moe_hf_name,
    stacked_expert,
)
from corefleet.kernels.gguf_quant import FORMATS, QuantFormat

logger = logging.getLogger(__name__)

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


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face parameter name for a GGUF tensor name, or None if it has none (a
    stacked expert tensor has many: ``_stacked_experts``)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    # blk.{i}.{kind}.{weight|bias}
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return moe_hf_name(gguf_name)


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


def quantized_weight_formats(path: str) -> dict[str, QuantFormat]:
    """The HF name and block format of every weight that stays quantized when loaded so.

    Those are the 2-D tensors whose GGUF type the kernels read; norms (F32), F16/BF16 tensors,
    the quant types without kernels and the experts, routers and shared-expert gates of an MoE
    file (``gguf_moe.keeps_float``) are dequantized instead.
    """
    reader = open_gguf(path)
    formats: dict[str, QuantFormat] = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        fmt = FORMATS.get(int(tensor.tensor_type))
        if name is None or fmt is None or len(tensor.shape) != 2 or keeps_float(name):
            continue
        formats[name] = fmt
    return formats


def iter_gguf_weights(
    path: str, dtype: torch.dtype, keep_quantized: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every weight in the GGUF file.

    Dequantized to ``dtype``, or, with ``keep_quantized``, the weights of
    ``quantized_weight_formats`` as ``uint8 [N, row_bytes]`` blocks (the rest dequantized).
    The file is opened and its architecture checked now; tensors are read lazily.

    Raises:
        ValueError: unreadable file, unsupported architecture, or (while iterating) a tensor
            with no Llama counterpart.
    """
    reader = open_gguf(path)
    arch = gguf_architecture(reader, path)
    quantized = quantized_weight_formats(path) if keep_quantized else {}
    return _generate_gguf_weights(reader, arch, path, dtype, quantized)


def _generate_gguf_weights(
    reader: Any, arch: str, path: str, dtype: torch.dtype, quantized: dict[str, QuantFormat]
) -> Iterator[tuple[str, torch.Tensor]]:
    heads = int(gguf_value(reader, f"{arch}.attention.head_count"))
    kv_heads = int(gguf_value(reader, f"{arch}.attention.head_count_kv", heads))
    permuted = arch in _PERMUTED_QK
    dequantized: Counter[str] = Counter()
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS_TENSOR:
            continue  # folded into ArchConfig.rope_scaling
        if stacked_expert(tensor.name) is not None:
            yield from _stacked_experts(tensor, dtype)
            continue
        name = hf_name(tensor.name)
        if name is None:
            raise ValueError(f"{path}: GGUF tensor {tensor.name!r} has no Llama counterpart")
        if name in quantized:
            weight = _read_blocks(path, tensor)
        else:
            weight = _dequantized(tensor, dtype)
            if quantized and len(tensor.shape) == 2 and not keeps_float(name):
                dequantized[tensor.tensor_type.name] += 1  # a format without a kernel
        if permuted and tensor.name.endswith((".attn_q.weight", ".attn_q.bias")):
            weight = unpermute_rotary(weight, heads)
        elif permuted and tensor.name.endswith((".attn_k.weight", ".attn_k.bias")):
            weight = unpermute_rotary(weight, kv_heads)
        elif name.endswith(SHARED_EXPERT_GATE):
            weight = weight.reshape(1, -1)  # llama.cpp keeps it [H]; the model's Linear is [1, H]
        yield name, weight
    for type_name, count in sorted(dequantized.items()):
        logger.warning(
            "%s: %d weight(s) of type %s dequantized to %s (no kernel reads %s blocks; "
            "kept quantized: %s)",
            path,
            count,
            type_name,
            dtype,
            type_name,
            ", ".join(sorted({f.name for f in FORMATS.values()})),
        )


def _stacked_experts(tensor: Any, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """One layer's experts of one projection, ``[E, rows, cols]`` in the file, as one HF tensor
    per expert (views of the dequantized whole, which the loader copies)."""
    located = stacked_expert(tensor.name)
    assert located is not None
    layer, proj = located
    weights = _dequantized(tensor, dtype)
    for expert in range(weights.shape[0]):
        yield f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight", weights[expert]


def _dequantized(tensor: Any, dtype: torch.dtype) -> torch.Tensor:
    array = dequantize_tensor(tensor)
    if not array.flags.writeable:
        # F32 tensors come back as views of the read-only memory map.
        array = array.copy()
    return torch.from_numpy(array).to(dtype)


def _read_blocks(path: str, tensor: Any) -> torch.Tensor:  # uint8 [N, row_bytes]
    """A quantized tensor's bytes, read from the file (not through the reader's mapping)."""
    rows = int(tensor.shape[1])  # ggml order: [K, N]
    blocks = torch.empty(rows, int(tensor.n_bytes) // rows, dtype=torch.uint8)
    with open(path, "rb") as file:
        file.seek(int(tensor.data_offset))
        got = file.readinto(blocks.numpy().data)
    if got != tensor.n_bytes:
        raise ValueError(
            f"{path}: GGUF tensor {tensor.name!r} is truncated ({got} of {tensor.n_bytes} bytes)"
        )
    return blocks
