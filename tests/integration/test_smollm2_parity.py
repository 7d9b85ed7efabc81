"""The engine on the real SmolLM2 equals transformers' greedy generate token for token."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from corefleet.engine import LLM, SamplingParams
from corefleet.engine.client.base import MPClientOptions
from corefleet.engine.client.mp import AsyncMPClient, SyncMPClient
from corefleet.engine.config import EngineConfig
from corefleet.engine.messages import EngineCoreRequest
from tests.integration.hf_reference import hf_greedy

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):\n    ",
    "Kubernetes is a container orchestration system that",
    "Once upon a time, in a small village at the edge of a dark forest, there lived an old "
    "woman who kept bees. Every morning she",
    "Q: What is 12 times 7?\nA:",
    "The three laws of thermodynamics are",
    "List five fruits:\n1.",
    "In machine learning, a transformer model uses attention to weigh the importance of each "
    "token in a sequence relative to the others. Explain, in simple words, why this matters "
    "for translation between languages that order words differently, and give an example "
    "with English and German sentences where the verb moves to the end.",
    "Hello",
]
NEW_TOKENS = 48
# transformers runs float32 throughout: so do activations and KV cache here (the weights stay
# in the file's GGUF blocks, the default, and are dequantized in the kernels).
FLOAT32: dict[str, str] = {"dtype": "float32", "kv_cache_dtype": "float32"}
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompt_ids(smollm2_path: str) -> list[list[int]]:
    from corefleet.engine.frontend.tokenizer import Tokenizer

    tok = Tokenizer.from_model_path(smollm2_path)
    return [tok.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def hf_outputs(hf_smollm2, prompt_ids: list[list[int]]) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [hf_greedy(hf_smollm2, ids, NEW_TOKENS) for ids in prompt_ids]


def _generate(llm: LLM, prompt_ids: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    # The default LLM: the engine in a child process behind SyncMPClient.
    llm = LLM(**FLOAT32, kv_cache_memory=256 << 20, enable_prefix_caching=True)
    assert isinstance(llm.engine_client, SyncMPClient)
    yield llm
    llm.shutdown()


def test_batched_greedy_equals_hf(llm: LLM, prompt_ids, hf_outputs) -> None:  # type: ignore[no-untyped-def]
    assert len({len(p) for p in prompt_ids}) >= 8, "prompts must have different lengths"
    assert _generate(llm, prompt_ids) == hf_outputs


def test_chunked_prefill_and_preemption_change_nothing(prompt_ids, hf_outputs) -> None:  # type: ignore[no-untyped-def]
    # A 32-token budget splits every long prompt into chunks mixed with decodes, and 24 blocks
    # of 16 tokens cannot hold ten requests of 50-130 tokens at once: requests are preempted
    # and recomputed.
    small = LLM(
        **FLOAT32,
        num_blocks_override=24,
        max_num_batched_tokens=32,
        enable_prefix_caching=False,
    )
    assert _generate(small, prompt_ids) == hf_outputs
    assert small.get_scheduler_stats().num_preemptions > 0
    small.shutdown()


def test_prefix_cache_hits_and_changes_no_output(llm: LLM, prompt_ids, hf_outputs) -> None:  # type: ignore[no-untyped-def]
    long_prompt = prompt_ids[8]  # > 3 blocks of 16 tokens
    assert llm.reset_prefix_cache()  # no request holds blocks between calls
    first = llm.generate({"prompt_token_ids": long_prompt}, GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    again = llm.generate({"prompt_token_ids": long_prompt}, GREEDY, use_tqdm=False)[0]
    # Every full block but the one holding the last prompt token is reused.
    assert again.num_cached_tokens >= (len(long_prompt) - 1) // 16 * 16 - 16
    assert again.num_cached_tokens > 0
    stats = llm.get_scheduler_stats()
    assert stats.prefix_cache_hits >= again.num_cached_tokens
    assert first.outputs[0].token_ids == hf_outputs[8]
    assert again.outputs[0].token_ids == hf_outputs[8]


def test_chat_template_and_text(llm: LLM) -> None:
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(max_tokens=24, temperature=0.0),
    )[0]
    assert out.prompt is not None and out.prompt.startswith("<|im_start|>")
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason in ("stop", "length")


def test_async_client_equals_hf(prompt_ids, hf_outputs) -> None:  # type: ignore[no-untyped-def]
    async def run(client: AsyncMPClient) -> list[list[int]]:
        for i, ids in enumerate(prompt_ids):
            await client.add_request_async(EngineCoreRequest(str(i), ids, GREEDY))
        tokens: list[list[int]] = [[] for _ in prompt_ids]
        pending = set(range(len(prompt_ids)))
        while pending:
            outputs = await asyncio.wait_for(client.get_output_async(), timeout=120)
            for out in outputs.outputs:
                tokens[int(out.request_id)] += out.new_token_ids
                if out.finished:
                    pending.discard(int(out.request_id))
        return tokens

    config = EngineConfig.from_kwargs(**FLOAT32, kv_cache_memory=256 << 20)
    client = AsyncMPClient(config, MPClientOptions())
    try:
        assert asyncio.run(run(client)) == hf_outputs
    finally:
        client.shutdown()
