"""Stream a model's weights, whichever its source, under Hugging Face Llama names and shapes."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import torch

from corefleet.engine.models.gguf_weights import iter_gguf_weights
from corefleet.engine.models.hf_loader import iter_hf_weights
from corefleet.engine.models.loader import resolve_model_path


def load_weights(
    path: str | os.PathLike[str], dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` pairs for every weight of the model at ``path``.

    Names follow Hugging Face Llama (``model.layers.{i}.self_attn.q_proj.weight``, ...);
    ``lm_head.weight`` only appears for untied models. Tensors have HF shapes
    (``[out_features, in_features]``), are converted to ``dtype``, and are yielded one at a
    time so peak memory stays near one tensor above the model itself.

    The path is validated when this is called, not when iteration starts, so a bad path fails
    at the call site.

    Raises:
        ValueError: missing or unsupported model, or a GGUF tensor with no Llama counterpart.
    """
    resolved = Path(resolve_model_path(os.fspath(path)))
    if resolved.is_dir():
        return iter_hf_weights(resolved, dtype)
    return iter_gguf_weights(str(resolved), dtype)
