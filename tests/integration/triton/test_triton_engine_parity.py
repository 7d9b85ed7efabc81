"""The engine with ``attention_backend="triton"`` (interpreted on CPU) equals transformers.

Every layer op and the paged attention then run as Triton kernels, fed by the model runner's
block-table metadata. The interpreter is slow (each kernel program is numpy, one after another),
so the prompt sets are short; the kernels' own shape matrix is in ``tests/unit/triton``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from corefleet.engine import LLM, SamplingParams
from tests.fixtures_models import write_tiny_model
from tests.integration.hf_reference import hf_greedy
from tests.integration.test_smollm2_parity import PROMPTS as SMOLLM2_PROMPTS
from tests.integration.test_tiny_model_parity import _engine_outputs, _hf_outputs
from tests.kernel_cases import require_interpreted_kernels

require_interpreted_kernels()


def test_tiny_model_greedy_equals_hf(tmp_path: Path) -> None:
    folder = write_tiny_model(tmp_path / "m", num_kv_heads=2)  # GQA 2
    assert _engine_outputs(folder, attention_backend="triton") == _hf_outputs(folder)


def test_tiny_model_chunks_small_blocks_and_preemption(tmp_path: Path) -> None:
    # Blocks of 4 tokens, an 8-token step budget and too few blocks: every step mixes prefill
    # chunks with decodes over many partial blocks, and preempted requests are recomputed.
    folder = write_tiny_model(tmp_path / "m", tie_word_embeddings=True, num_kv_heads=1)  # GQA 4
    outputs = _engine_outputs(
        folder,
        attention_backend="triton",
        block_size=4,
        max_num_batched_tokens=8,
        num_blocks_override=48,
    )
    assert outputs == _hf_outputs(folder)


@pytest.mark.slow
def test_smollm2_greedy_equals_hf(hf_smollm2, smollm2_path: str) -> None:  # type: ignore[no-untyped-def]
    from corefleet.engine.frontend.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_model_path(smollm2_path)
    # A short, a long and a code prompt, in one batch: with a 32-token step budget the long
    # prompt is prefilled in chunks while the others already decode.
    prompts = [tokenizer.encode(SMOLLM2_PROMPTS[i]) for i in (0, 8, 2)]
    new_tokens = 8
    expected = [hf_greedy(hf_smollm2, ids, new_tokens) for ids in prompts]
    # The engine in its own process (the default), which inherits TRITON_INTERPRET=1.
    # Dequantized weights: under the interpreter the GGUF matmuls of every layer would take
    # minutes (test_triton_gguf_engine.py runs them on a tiny model); this test is about the
    # attention and layer kernels against transformers.
    llm = LLM(
        dtype="float32",
        quantization="none",
        attention_backend="triton",
        kv_cache_memory=64 << 20,
        max_num_batched_tokens=32,
    )
    try:
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == expected
