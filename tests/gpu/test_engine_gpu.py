"""The engine on a GPU with the Triton backend equals transformers' greedy output (float32).

float32 keeps the comparison exact enough for token equality: the Triton attention takes
IEEE (not TF32) dots for float32, and torch's float32 matmuls do not use TF32 by default.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.gpu.gpu_support import require_cuda

require_cuda()

from corefleet.engine import LLM, SamplingParams  # noqa: E402
from tests.fixtures_models import write_tiny_model  # noqa: E402
from tests.integration.hf_reference import hf_greedy  # noqa: E402
from tests.integration.test_smollm2_parity import PROMPTS  # noqa: E402
from tests.integration.test_tiny_model_parity import PROMPTS as TINY_PROMPTS  # noqa: E402
from tests.integration.test_tiny_model_parity import _hf_outputs  # noqa: E402

pytestmark = pytest.mark.gpu
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _generate(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("block_size", [4, 16])
def test_tiny_model_on_gpu_equals_hf(tmp_path: Path, block_size: int) -> None:
    folder = write_tiny_model(tmp_path / "m", num_kv_heads=2)
    llm = LLM(
        str(folder),
        multiprocess=False,
        device="cuda",
        dtype="float32",
        attention_backend="triton",
        block_size=block_size,
        max_num_batched_tokens=16,  # chunked prefill mixed with decodes
        gpu_memory_utilization=0.3,
    )
    try:
        assert _generate(llm, TINY_PROMPTS, GREEDY) == _hf_outputs(folder)
    finally:
        llm.shutdown()


def test_smollm2_on_gpu_equals_hf(hf_smollm2, smollm2_path: str) -> None:  # type: ignore[no-untyped-def]
    from corefleet.engine.frontend.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_model_path(smollm2_path)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    expected = [hf_greedy(hf_smollm2, ids, 48) for ids in prompts]
    llm = LLM(
        device="cuda",
        dtype="float32",
        attention_backend="triton",
        max_num_batched_tokens=64,
        gpu_memory_utilization=0.3,
    )
    try:
        assert _generate(llm, prompts, params) == expected
    finally:
        llm.shutdown()
