"""Prompt logprobs: the scheduler computes such a prompt whole (no prefix-cache read), the runner
scores every prompt position across prefill chunks, and the rows reach the RequestOutput."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from corefleet.engine import LLM, SamplingParams
from corefleet.engine.core.scheduler_output import ModelRunnerOutput
from corefleet.engine.messages import Logprobs
from tests.fixtures_models import write_tiny_llama
from tests.unit.scheduler_helpers import make_request, make_scheduler, outputs_by_id, script, step

# ------------------------------------------------------------------------------ scheduler


def test_prompt_logprobs_request_skips_reading_the_prefix_cache() -> None:
    sched = make_scheduler(max_num_batched_tokens=256)
    prompt = list(range(1000, 1040))
    first = make_request(sched, "a", prompt, max_tokens=1)
    step(sched, script({"a": [5]}))
    assert "a" not in sched.requests  # finished: its full blocks are in the cache
    make_request(sched, "b", [*prompt, 1], max_tokens=1, prompt_logprobs=2)
    out, eo = step(sched, script({"b": [5]}))
    (new,) = out.scheduled_new_reqs
    # The cache holds 32 of its tokens, but it computes all 41 and reports no hit.
    assert new.num_computed_tokens == 0 and out.num_scheduled_tokens == {"b": 41}
    assert outputs_by_id(eo)["b"].num_cached_tokens == 0
    make_request(sched, "c", [*prompt, 2], max_tokens=1)  # the same prefix, without: a hit
    out, _ = step(sched, script({"c": [5]}))
    assert out.scheduled_new_reqs[0].num_computed_tokens == 32
    assert first.num_cached_tokens == 0


def test_prompt_logprobs_ride_on_the_first_output() -> None:
    sched = make_scheduler()
    make_request(sched, "a", 5, max_tokens=2, prompt_logprobs=0)
    out = sched.schedule()
    rows = Logprobs([[11]] * 4, [[-1.5]] * 4, [3] * 4)
    runner = ModelRunnerOutput(["a"], [[7]], prompt_logprobs={"a": rows})
    first = outputs_by_id(sched.update_from_output(out, runner))["a"]
    assert first.new_token_ids == [7] and first.new_prompt_logprobs == rows
    out, eo = step(sched)
    assert outputs_by_id(eo)["a"].new_prompt_logprobs is None


@pytest.mark.parametrize("value", [-1, 21, 10**12])
def test_prompt_logprobs_bounded(value: int) -> None:
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value).validate()


# ------------------------------------------------------------------------------ runner


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "m")


def _engine(folder: Path, budget: int) -> LLM:
    return LLM(
        str(folder),
        multiprocess=False,
        dtype="float32",
        kv_cache_memory=8 << 20,
        block_size=4,
        max_num_batched_tokens=budget,
        enable_prefix_caching=True,
    )


@torch.inference_mode()
def _reference(folder: Path, ids: list[int]) -> torch.Tensor:
    """transformers' float32 log-softmax at every prompt position: ``[P, V]``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    logits = model(torch.tensor([ids])).logits[0]  # [P, V]
    return torch.log_softmax(logits.float(), dim=-1)


def test_runner_scores_every_prompt_position_across_chunks(tiny: Path) -> None:
    ids = [(7 * i + 3) % 300 + 3 for i in range(37)]
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3)
    # A budget of 8 tokens splits the 37-token prompt into five chunks.
    llm = _engine(tiny, budget=8)
    try:
        warm = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1), use_tqdm=False)
        assert warm[0].prompt_logprobs is None  # only when asked
        out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    finally:
        llm.shutdown()
    # The prompt is cached by the first request, yet every position was computed again.
    assert out.num_cached_tokens == 0
    rows = out.prompt_logprobs
    assert rows is not None and len(rows) == len(ids) and rows[0] is None
    expected = _reference(tiny, ids)
    for position in range(1, len(ids)):
        row = rows[position]
        assert row is not None
        token = ids[position]
        reference = expected[position - 1]  # the logits before a token predict it
        assert row[token].logprob == pytest.approx(reference[token].item(), abs=2e-3)
        assert row[token].rank == int((reference > reference[token]).sum()) + 1
        assert len(row) <= 4  # the prompt token and the top 3
        top = {t for t, entry in row.items() if entry.rank is not None and entry.rank <= 3}
        assert top == set(reference.topk(3).indices.tolist()) or _ties(reference, 3)
        for t in top:
            assert row[t].logprob == pytest.approx(reference[t].item(), abs=2e-3)


def _ties(values: torch.Tensor, k: int) -> bool:
    """Whether the k-th and (k+1)-th largest are equal (then the top-k set is ambiguous)."""
    top = values.topk(k + 1).values
    return bool(torch.isclose(top[k - 1], top[k]))
