"""Stream a model's weights, whichever its source, under Hugging Face Llama names and shapes."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import torch

from corefleet.engine.models.gguf_weights import iter_gguf_weights, quantized_weight_formats
from corefleet.engine.models.hf_loader import iter_hf_weights
from corefleet.engine.models.loader import is_gguf, resolve_model_path
from corefleet.kernels.gguf_quant import QuantFormat


def load_weights(
    path: str | os.PathLike[str], dtype: torch.dtype, keep_quantized: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` pairs for every weight of the model at ``path``.

    Names follow Hugging Face Llama (``model.layers.{i}.self_attn.q_proj.weight``, ...);
    ``lm_head.weight`` only appears for untied models. Tensors have HF shapes
    (``[out_features, in_features]``), are converted to ``dtype``, and are yielded one at a
    time so peak memory stays near one tensor above the model itself. With ``keep_quantized``
    a GGUF file's weights in a format the kernels read come as ``uint8`` blocks instead
    (``quantized_weights`` names them).

    The path is validated when this is called, not when iteration starts, so a bad path fails
    at the call site.

    Raises:
        ValueError: missing or unsupported model, or a GGUF tensor with no Llama counterpart.
    """
    resolved = Path(resolve_model_path(os.fspath(path)))
    if resolved.is_dir():
        return iter_hf_weights(resolved, dtype)
    return iter_gguf_weights(str(resolved), dtype, keep_quantized)


def quantized_weights(path: str | os.PathLike[str], quantization: str) -> dict[str, QuantFormat]:
    """The weights (by HF name) that ``--quantization`` keeps in their GGUF block format.

    ``auto`` and ``gguf`` keep a GGUF file's supported blocks; ``none`` keeps nothing.

    Raises:
        ValueError: ``gguf`` for a model that is not a GGUF file.
    """
    resolved = resolve_model_path(os.fspath(path))
    if quantization == "none":
        return {}
    if not is_gguf(resolved):
        if quantization == "gguf":
            raise ValueError(
                f"invalid engine argument quantization='gguf': {resolved} is not a .gguf file "
                "(a Hugging Face folder runs with --quantization none or auto)"
            )
        return {}
    return quantized_weight_formats(resolved)
