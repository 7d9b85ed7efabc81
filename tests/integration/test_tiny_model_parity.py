"""Tiny random Llama-family models in HF format: the engine equals transformers' greedy output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from corefleet.engine import LLM, SamplingParams
from tests.fixtures_models import write_tiny_model
from tests.integration.hf_reference import hf_greedy

PROMPTS = [
    [5 + (i * 7 + j * 13) % 300 for j in range(length)]
    for i, length in enumerate([3, 17, 40, 1, 64, 9, 33, 100])
]
NEW_TOKENS = 24


def _hf_outputs(folder: Path) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]


def _engine_outputs(
    folder: Path, params: SamplingParams | None = None, **engine_args: object
) -> list[list[int]]:
    # In-process: these compare numerics over many model shapes; the process hop is covered
    # by test_engine_proc.py and the SmolLM2 parity test. The cache dtype is left to auto, the
    # model's (float32): a bfloat16 cache by default on CPUs with AVX512-BF16 made a tiny
    # Qwen2-MoE equal on 3 of 4 prompts.
    llm = LLM(
        str(folder),
        multiprocess=False,
        dtype="float32",
        kv_cache_memory=16 << 20,
        **engine_args,
    )
    params = params or SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize(
    ("architecture", "tied", "num_kv_heads"),
    [
        ("llama", False, 2),
        ("llama", True, 1),
        ("llama", False, 4),
        ("qwen2", False, 2),
        ("mistral", True, 2),
    ],
)
def test_greedy_equals_hf(tmp_path: Path, architecture: str, tied: bool, num_kv_heads: int) -> None:
    folder = write_tiny_model(
        tmp_path / "m",
        architecture=architecture,
        tie_word_embeddings=tied,
        num_kv_heads=num_kv_heads,
    )
    expected = _hf_outputs(folder)
    assert _engine_outputs(folder) == expected


def test_small_blocks_chunks_and_preemption_change_nothing(tmp_path: Path) -> None:
    folder = write_tiny_model(tmp_path / "m", num_kv_heads=2)
    expected = _hf_outputs(folder)
    # Blocks of 4 tokens, an 8-token step budget and a pool too small for all eight requests:
    # chunked prefill, many partial blocks and preemption by recompute all happen.
    assert (
        _engine_outputs(folder, block_size=4, max_num_batched_tokens=8, num_blocks_override=48)
        == expected
    )


def test_a_seeded_request_samples_the_same_tokens_whether_preempted_or_not(
    tmp_path: Path,
) -> None:
    # Its random stream goes on where it stopped when it resumes: preemption (which the
    # load decides) does not change what a seeded request answers.
    folder = write_tiny_model(tmp_path / "m", num_kv_heads=2)
    # 48 tokens: requests are preempted after they sampled some (the longest, 100 + 48
    # tokens, still fits the 48 blocks of 4 alone).
    seeded = SamplingParams(max_tokens=48, temperature=1.0, seed=11, ignore_eos=True)
    tight = {"block_size": 4, "max_num_batched_tokens": 8, "num_blocks_override": 48}
    llm = LLM(
        str(folder),
        multiprocess=False,
        dtype="float32",
        kv_cache_dtype="float32",
        kv_cache_memory=16 << 20,
        **tight,
    )
    preempted = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], seeded, use_tqdm=False)
    assert llm.get_scheduler_stats().num_preemptions > 0
    llm.shutdown()
    alone = _engine_outputs(folder, seeded)
    assert [o.outputs[0].token_ids for o in preempted] == alone


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_every_cpu_attention_backend_equals_hf(tmp_path: Path, backend: str) -> None:
    """The torch reference (the CUDA fallback, which derives its decode mask from the context
    lengths) and the C++ kernel, through the engine, on a GQA model."""
    folder = write_tiny_model(tmp_path / "m", num_kv_heads=2)
    assert _engine_outputs(folder, attention_backend=backend) == _hf_outputs(folder)


def test_a_kv_cache_smaller_than_the_context_bounds_every_request(tmp_path: Path) -> None:
    # 24 blocks of 4 tokens (one is the null block): 92 tokens. A request that could grow past
    # them could never run alone; it was preempted and recomputed forever. Now the context
    # stops at what the cache holds, and the request ends with "length".
    folder = write_tiny_model(tmp_path / "m", num_kv_heads=2)
    tight = {"block_size": 4, "num_gpu_blocks_override": 24}
    llm = LLM(str(folder), multiprocess=False, dtype="float32", kv_cache_memory=16 << 20, **tight)
    try:
        prompt = [{"prompt_token_ids": PROMPTS[4]}]  # 64 tokens
        too_many = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
        with pytest.raises(ValueError, match="max_model_len is 92"):
            llm.generate(prompt, too_many, use_tqdm=False)
        up_to_the_context = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)
        completion = llm.generate(prompt, up_to_the_context, use_tqdm=False)[0].outputs[0]
        assert completion.finish_reason == "length"
        assert len(completion.token_ids) == 92 - 64
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match=r"max_model_len=200: the KV cache holds 92 tokens"):
        LLM(str(folder), multiprocess=False, max_model_len=200, kv_cache_memory=16 << 20, **tight)
