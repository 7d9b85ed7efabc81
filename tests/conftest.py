"""Shared fixtures: the embedded SmolLM2 GGUF and transformers as the reference."""

from __future__ import annotations

import collections
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

MiB = 1 << 20


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Items that share a node id get ids of their own, from their names; a node id that is
    still shared after that stops the run.

    schemathesis' `schema.parametrize()` (tests/integration/test_openapi.py) makes one item per
    API operation, named `test[POST /v1/completions]` but all with the function's node id.
    pytest runs them all; pytest-xdist (`make test`) schedules by node id and ran one of the
    seven, silently. pytest has no public way to set a node id after collection: `_id` is the
    field `nodeid` reads (pytest 9).
    """
    counts = collections.Counter(item.nodeid for item in items)
    for item in items:
        if counts[item.nodeid] > 1 and item.parent is not None and item.name not in item.nodeid:
            item._id = item.parent.id.child(item.name)
    shared = [nodeid for nodeid, n in collections.Counter(i.nodeid for i in items).items() if n > 1]
    if shared:
        raise pytest.UsageError(f"tests share a node id, so pytest-xdist would run one: {shared}")


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
