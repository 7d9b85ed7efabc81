"""A GGUF model kept quantized runs on the Triton backend (interpreted) as on the torch one.

Every layer, the embedding and the LM head stay in their blocks, a different format each (as in
a Q4_K_M file, with the 32-value formats too), so every ``quant_linear`` and
``quant_embedding`` of the step goes through ``triton_ops/gguf_matmul.py``. The torch backend
dequantizes the same bytes with the reference; float32 throughout, so the two differ only in
the order of each dot product's sums.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from corefleet.engine import LLM, SamplingParams
from tests.fixtures_models import write_tiny_gguf, write_tiny_model
from tests.kernel_cases import require_interpreted_kernels

require_interpreted_kernels()

QUANT = {
    "attn_q": "Q4_K",
    "attn_k": "Q4_K",
    "attn_v": "Q6_K",
    "attn_output": "Q5_K",
    "ffn_gate": "Q4_0",
    "ffn_up": "Q4_1",
    "ffn_down": "Q6_K",
    "token_embd": "Q8_0",
    "output": "Q4_K",
}
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)


def _generate(path: Path, backend: str):  # type: ignore[no-untyped-def]
    llm = LLM(
        str(path),
        multiprocess=False,
        dtype="float32",
        kv_cache_dtype="float32",
        kv_cache_memory=32 << 20,
        quantization="gguf",
        attention_backend=backend,
    )
    try:
        outs = llm.generate(["def add(a, b):", "hello world"], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    return [o.outputs[0] for o in outs]


def test_quantized_gguf_on_triton_equals_torch_backend(tmp_path: Path) -> None:
    # hidden and intermediate multiples of 256: every format's block fits every matrix.
    folder = write_tiny_model(tmp_path / "hf", hidden_size=256, intermediate_size=512, seed=3)
    path = write_tiny_gguf(tmp_path / "model.gguf", folder, quant=QUANT)
    expected = _generate(path, "torch")
    actual = _generate(path, "triton")
    for got, want in zip(actual, expected, strict=True):
        assert got.token_ids == want.token_ids
        for got_step, want_step in zip(got.logprobs, want.logprobs, strict=True):
            token = next(iter(want_step))
            assert got_step[token].logprob == pytest.approx(want_step[token].logprob, abs=1e-4)
