"""Mixture-of-experts GGUF files: Mixtral (``llama`` with experts), Qwen2-MoE, Qwen3-MoE, OLMoE.

What llama.cpp's files hold, and what they leave to its code (so this module states it):

* Metadata: ``{arch}.expert_count``, ``{arch}.expert_used_count``, and for the Qwen MoEs
  ``{arch}.expert_feed_forward_length`` (an expert's intermediate size; Mixtral and OLMoE use
  ``{arch}.feed_forward_length``) and ``{arch}.expert_shared_feed_forward_length`` (the shared
  expert's). Key strings are ``gguf.constants.Keys``'.
* Tensors (``gguf.constants.TENSOR_NAMES``): the experts stacked, ``blk.N.ffn_{gate,up,down}_exps``
  ``[E, I, H]`` / ``[E, H, I]`` in Hugging Face order (GGUF lists dimensions fastest-first); the
  router ``ffn_gate_inp``; Qwen2-MoE's shared expert ``ffn_{gate,up,down}_shexp`` and its gate
  ``ffn_gate_inp_shexp`` (``[H]`` or ``[1, H]``); q/k norms ``attn_q_norm``/``attn_k_norm``.
  Mixtral files from before the stacking hold one 2-D tensor per expert,
  ``blk.N.ffn_gate.{e}.weight``: read too.
* Not stored: whether the top-k weights are renormalised. llama.cpp hard-codes it per
  architecture (the ``norm_w`` argument of ``build_moe_ffn`` in src/models/llama.cpp: true,
  qwen2moe.cpp: false, qwen3moe.cpp: true, olmoe.cpp: false); so does ``_RENORMALIZE``.
* Rotary: llama.cpp's ``llama_model_rope_type`` (src/llama-model.cpp) runs ``llama`` with its
  "normal" interleaved kernel, so Mixtral's q/k rows are permuted in the file like Llama's
  (``gguf_weights``), and qwen2moe, qwen3moe and olmoe with the NeoX kernel: stored unpermuted.

A layer without a router (``ffn_gate_inp``) is dense (``MoESpec.dense_layers``), named as a
dense FFN (``ffn_gate``/``ffn_up``/``ffn_down``), which is how Qwen's ``mlp_only_layers`` look.

Nothing here needs torch: the coordinator reads a model's architecture through this module.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Collection, Sequence
from typing import Any

from corefleet.engine.models.arch import MoESpec

# GGUF general.architecture -> the HF architecture, for the files that are always MoE. A
# ``llama`` file is Mixtral when it has experts (``moe_architecture``).
MOE_GGUF_ARCHITECTURES: dict[str, str] = {
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}
MIXTRAL = "MixtralForCausalLM"
# llama.cpp's per-architecture renormalisation of the top-k weights (the module docstring).
_RENORMALIZE = {
    MIXTRAL: True,
    "Qwen2MoeForCausalLM": False,
    "Qwen3MoeForCausalLM": True,
    "OlmoeForCausalLM": False,
}
_QWEN = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
# Qwen3-MoE's q/k norms are per head ([head_dim]), OLMoE's over the projection ([q], [kv]).
_QK_NORM = {"Qwen3MoeForCausalLM": "head", "OlmoeForCausalLM": "projection"}
# The HF name of the shared expert's gate, which llama.cpp may store 1-D.
SHARED_EXPERT_GATE = "mlp.shared_expert_gate.weight"
_HF_PROJ = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}

Meta = Callable[[str], Any]  # a ``{arch}.`` key -> its value, or None


@functools.cache
def _tensor_kinds() -> dict[str, str]:
    """``blk.N.<kind>`` of each MoE tensor (from the gguf package's names) -> its HF module
    under ``model.layers.N.`` (the experts' entry is the projection, ``gate``/``up``/``down``)."""
    from gguf.constants import MODEL_TENSOR, TENSOR_NAMES  # only GGUF users pay for it

    kinds = {
        MODEL_TENSOR.FFN_GATE_INP: "mlp.gate",
        MODEL_TENSOR.FFN_GATE_INP_SHEXP: SHARED_EXPERT_GATE.removesuffix(".weight"),
        MODEL_TENSOR.FFN_GATE_SHEXP: "mlp.shared_expert.gate_proj",
        MODEL_TENSOR.FFN_UP_SHEXP: "mlp.shared_expert.up_proj",
        MODEL_TENSOR.FFN_DOWN_SHEXP: "mlp.shared_expert.down_proj",
        MODEL_TENSOR.ATTN_Q_NORM: "self_attn.q_norm",
        MODEL_TENSOR.ATTN_K_NORM: "self_attn.k_norm",
        MODEL_TENSOR.FFN_GATE_EXP: "gate",
        MODEL_TENSOR.FFN_UP_EXP: "up",
        MODEL_TENSOR.FFN_DOWN_EXP: "down",
        # Dense FFN kinds: with an expert index after them, an old Mixtral file's expert.
        MODEL_TENSOR.FFN_GATE: "gate",
        MODEL_TENSOR.FFN_UP: "up",
        MODEL_TENSOR.FFN_DOWN: "down",
    }
    return {TENSOR_NAMES[tensor].rpartition(".")[2]: hf for tensor, hf in kinds.items()}


@functools.cache
def _kind(name: str) -> str:
    """The ``<kind>`` of ``blk.N.<kind>`` for a ``gguf.constants.MODEL_TENSOR`` name."""
    from gguf.constants import MODEL_TENSOR, TENSOR_NAMES

    return TENSOR_NAMES[getattr(MODEL_TENSOR, name)].rpartition(".")[2]


def _kinds(*names: str) -> frozenset[str]:
    return frozenset(_kind(name) for name in names)


def stacked_expert(gguf_name: str) -> tuple[int, str] | None:
    """``(layer, HF projection)`` of a stacked expert tensor ``blk.N.ffn_*_exps.weight``."""
    parts = gguf_name.split(".")
    stacked = _kinds("FFN_GATE_EXP", "FFN_UP_EXP", "FFN_DOWN_EXP")
    if len(parts) != 4 or parts[0] != "blk" or not parts[1].isdigit() or parts[2] not in stacked:
        return None
    return int(parts[1]), _HF_PROJ[_tensor_kinds()[parts[2]]]


def moe_hf_name(gguf_name: str) -> str | None:
    """The HF name of a 2-D or 1-D MoE tensor (router, shared expert, q/k norm, an old Mixtral
    file's per-expert ``blk.N.ffn_gate.{e}.weight``), or None for any other tensor."""
    parts = gguf_name.split(".")
    if len(parts) < 4 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    layer, kind, kinds = parts[1], parts[2], _tensor_kinds()
    dense = _kinds("FFN_GATE", "FFN_UP", "FFN_DOWN")
    if len(parts) == 5 and kind in dense and parts[3].isdigit() and parts[4] == "weight":
        return f"model.layers.{layer}.mlp.experts.{parts[3]}.{_HF_PROJ[kinds[kind]]}.weight"
    # The rest are 4 parts; a dense FFN's names are gguf_weights', the stacked experts many.
    not_single = dense | _kinds("FFN_GATE_EXP", "FFN_UP_EXP", "FFN_DOWN_EXP")
    if len(parts) == 4 and kind in kinds and kind not in not_single:
        return f"model.layers.{layer}.{kinds[kind]}.{parts[3]}"
    return None


_FLOAT_ONLY = re.compile(r"\.mlp\.(gate|shared_expert_gate|experts\.\d+\.\w+)\.weight$")


def keeps_float(hf_name: str) -> bool:
    """Whether a weight is always dequantized: the experts (the quantized kernels take 2-D
    weights, and the experts run as one stacked parameter), the router and the shared
    expert's gate (plain float layers in the model)."""
    return _FLOAT_ONLY.search(hf_name) is not None


def moe_architecture(arch: str, meta: Meta, tensor_names: Sequence[str], path: str) -> str | None:
    """The HF architecture of an MoE GGUF file, or None for a dense one.

    Raises:
        ValueError: a ``llama`` file with expert tensors but no ``llama.expert_count``.
    """
    if arch in MOE_GGUF_ARCHITECTURES:
        return MOE_GGUF_ARCHITECTURES[arch]
    if arch != "llama":
        return None
    if int(meta(_key("EXPERT_COUNT")) or 0) > 0:
        return MIXTRAL
    # Every layout of experts (stacked or one tensor per expert) comes with a router.
    experts = [n for n in tensor_names if stacked_expert(n) or _is_router(n)]
    if experts:
        raise ValueError(
            f"{path}: a 'llama' GGUF file with expert tensors (e.g. {experts[0]!r}) but no "
            "llama.expert_count: it is neither a dense Llama nor a readable Mixtral"
        )
    return None


def moe_fields(
    hf_arch: str,
    meta: Meta,
    tensor_names: Collection[str],
    num_layers: int,
    ffn_length: int,
    path: str,
) -> dict[str, Any]:
    """The ``ArchConfig`` fields of an MoE file (``moe``, ``qk_norm``, ``clip_qkv``).

    ``tensor_names``: every tensor's GGUF name; ``ffn_length``: ``{arch}.feed_forward_length``.

    Raises:
        ValueError: what llama.cpp would run differently from the model code: a gating other
            than softmax, scaled expert weights, a shared expert without its gate.
    """
    count = int(meta(_key("EXPERT_COUNT")) or 0)
    top_k = int(meta(_key("EXPERT_USED_COUNT")) or 0)
    if count <= 0 or not 0 < top_k <= count:
        raise ValueError(
            f"{path}: {hf_arch} needs expert_count > 0 and 0 < expert_used_count <= it; the "
            f"file says {count} and {top_k}"
        )
    _refuse_other_routing(meta, path)
    router = _kind("FFN_GATE_INP")
    dense = tuple(i for i in range(num_layers) if f"blk.{i}.{router}.weight" not in tensor_names)
    shared_gate = _kind("FFN_GATE_INP_SHEXP")
    has_shared = any(n.split(".")[2:3] == [_kind("FFN_UP_SHEXP")] for n in tensor_names)
    if has_shared and not any(n.split(".")[2:3] == [shared_gate] for n in tensor_names):
        # Granite's shared experts ride on the llama architecture ungated; ours are gated.
        raise ValueError(f"{path}: shared experts without a {shared_gate} gate are not supported")
    fields: dict[str, Any] = {
        "qk_norm": _QK_NORM.get(hf_arch),
        # Only OLMoE clamps (inside its q/k norm step); llama.cpp's olmoe graph has no clamp.
        "clip_qkv": _clip(meta) if hf_arch == "OlmoeForCausalLM" else None,
        "moe": None,
    }
    if len(dense) == num_layers:
        return fields  # no sparse layer: a dense model under an MoE name, as hf_loader reads it
    # llama.cpp's fallbacks when a length is absent (src/models/qwen2moe.cpp, qwen3moe.cpp): a
    # Qwen expert is the FFN length over the experts a token takes, a shared expert all of it;
    # Mixtral's and OLMoE's experts are always the FFN length.
    expert_size = int(meta(_key("EXPERT_FEED_FORWARD_LENGTH")) or 0) or (
        ffn_length // top_k if hf_arch in _QWEN else ffn_length
    )
    shared_size = int(meta(_key("EXPERT_SHARED_FEED_FORWARD_LENGTH")) or ffn_length)
    fields["moe"] = MoESpec(
        num_experts=count,
        top_k=top_k,
        expert_intermediate_size=expert_size,
        renormalize=_RENORMALIZE[hf_arch],
        shared_expert_intermediate_size=shared_size if has_shared else 0,
        dense_layers=dense,
    )
    return fields


def _key(name: str) -> str:
    """A ``gguf.constants.Keys.LLM`` key without its ``{arch}.`` prefix (``meta`` adds it)."""
    from gguf.constants import Keys

    key: str = getattr(Keys.LLM, name)
    return key.removeprefix("{arch}.")


def _is_router(gguf_name: str) -> bool:
    parts = gguf_name.split(".")
    return len(parts) == 4 and parts[0] == "blk" and parts[2] == _kind("FFN_GATE_INP")


def _refuse_other_routing(meta: Meta, path: str) -> None:
    from gguf.constants import ExpertGatingFuncType

    gating = meta(_key("EXPERT_GATING_FUNC"))
    if gating is not None and int(gating) != ExpertGatingFuncType.SOFTMAX:
        raise ValueError(
            f"{path}: expert gating function {int(gating)} is not supported (softmax routing only)"
        )
    # llama.cpp scales the routing weights when the factor is neither 0 (unset) nor 1.
    scale = meta(_key("EXPERT_WEIGHTS_SCALE"))
    if scale is not None and float(scale) not in (0.0, 1.0):
        raise ValueError(f"{path}: scaled expert weights ({float(scale)}) are not supported")


def _clip(meta: Meta) -> float | None:
    """OLMoE's ``clip_qkv`` where a file states it (``{arch}.attention.clamp_kqv``; llama.cpp's
    converter writes none for OLMoE, whose released checkpoints have none)."""
    from gguf.constants import Keys

    clamp = meta(Keys.Attention.CLAMP_KQV.removeprefix("{arch}."))
    return None if clamp is None else float(clamp)
