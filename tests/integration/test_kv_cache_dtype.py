"""``--kv-cache-dtype auto`` is the model's dtype (vLLM's meaning): ``LLM(dtype="float32")``
alone gets a float32 cache and equals transformers in float32, on every CPU. A float32 model
used to get a bfloat16 cache on CPUs with AVX512-BF16, and then 8 of 10 SmolLM2 prompts were
equal over 40 tokens and prompts of thousands of tokens diverged after a few."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from corefleet.engine import LLM, SamplingParams
from tests.fixtures_models import write_tiny_model
from tests.integration.hf_reference import hf_greedy
from tests.integration.test_smollm2_parity import PROMPTS

pytestmark = pytest.mark.slow

NEW_TOKENS = 40
LONG_NEW_TOKENS = 16
RUNNER_LOGGER = "corefleet.engine.worker.model_runner"


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _dtype_lines(handler: _Lines) -> list[str]:
    return [line for line in handler.lines if line.startswith("dtype ")]


def _runner(llm: LLM):  # type: ignore[no-untyped-def]
    return llm.engine_client.engine.executor.runner  # type: ignore[attr-defined]


def _start(*args: str, **kwargs: object) -> tuple[LLM, list[str]]:
    """An in-process LLM on CPU (its runner is inspectable) and the dtype lines its start-up
    logged."""
    handler = _Lines()
    logger = logging.getLogger(RUNNER_LOGGER)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        llm = LLM(*args, multiprocess=False, device="cpu", **kwargs)  # type: ignore[arg-type]
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return llm, _dtype_lines(handler)


@pytest.fixture(scope="module")
def float32_llm() -> Iterator[tuple[LLM, list[str]]]:
    # dtype only: the cache dtype is left to auto.
    llm, lines = _start(dtype="float32", kv_cache_memory=512 << 20)
    yield llm, lines
    llm.shutdown()


@pytest.fixture(scope="module")
def prompt_ids(smollm2_path: str) -> list[list[int]]:
    from corefleet.engine.frontend.tokenizer import Tokenizer

    tok = Tokenizer.from_model_path(smollm2_path)
    return [tok.encode(p) for p in PROMPTS]


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def test_a_float32_model_gets_a_float32_cache_and_says_why(float32_llm) -> None:  # type: ignore[no-untyped-def]
    llm, lines = float32_llm
    runner = _runner(llm)
    assert runner.dtype == torch.float32
    assert runner.kv_dtype == torch.float32
    assert all(k.dtype == v.dtype == torch.float32 for k, v in runner.kv_caches)
    assert lines == [
        "dtype float32 (--dtype float32), "
        "KV cache dtype float32 (--kv-cache-dtype auto: the model's dtype)"
    ]


def test_float32_greedy_equals_transformers_over_40_tokens(  # type: ignore[no-untyped-def]
    float32_llm, hf_smollm2, prompt_ids
) -> None:
    llm, _ = float32_llm
    expected = [hf_greedy(hf_smollm2, ids, NEW_TOKENS) for ids in prompt_ids]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompt_ids], _greedy(NEW_TOKENS), use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_a_prompt_of_thousands_of_tokens_equals_transformers(  # type: ignore[no-untyped-def]
    float32_llm, hf_smollm2, prompt_ids
) -> None:
    # ~3000 tokens: the prompts joined and repeated (a bfloat16 cache diverged after 2-5 tokens).
    joined = [t for ids in prompt_ids for t in ids]
    long_prompt = (joined * (3000 // len(joined) + 1))[:3000]
    llm, _ = float32_llm
    out = llm.generate({"prompt_token_ids": long_prompt}, _greedy(LONG_NEW_TOKENS), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(hf_smollm2, long_prompt, LONG_NEW_TOKENS)


def test_an_explicit_cache_dtype_is_honoured(tmp_path: Path) -> None:
    folder = write_tiny_model(tmp_path / "m")
    llm, lines = _start(
        str(folder), dtype="float32", kv_cache_dtype="bfloat16", kv_cache_memory=16 << 20
    )
    try:
        runner = _runner(llm)
        assert runner.dtype == torch.float32
        assert runner.kv_dtype == torch.bfloat16
        assert all(k.dtype == v.dtype == torch.bfloat16 for k, v in runner.kv_caches)
        assert lines == [
            "dtype float32 (--dtype float32), KV cache dtype bfloat16 (--kv-cache-dtype bfloat16)"
        ]
        out = llm.generate({"prompt_token_ids": [5, 6, 7]}, _greedy(4), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.shutdown()


def test_dtype_auto_on_cpu_is_float32_with_a_float32_cache(tmp_path: Path) -> None:
    folder = write_tiny_model(tmp_path / "m")
    llm, lines = _start(str(folder), kv_cache_memory=16 << 20)
    try:
        assert _runner(llm).kv_dtype == torch.float32
        assert lines == [
            "dtype float32 (--dtype auto on CPU: float32), "
            "KV cache dtype float32 (--kv-cache-dtype auto: the model's dtype)"
        ]
    finally:
        llm.shutdown()
