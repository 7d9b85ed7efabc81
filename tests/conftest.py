"""Shared fixtures: the embedded SmolLM2 GGUF and transformers as the reference."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

MiB = 1 << 20


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from corefleet.engine.models.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path: str):  # type: ignore[no-untyped-def]
    """transformers' own model built from the same GGUF file (float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model.eval()
