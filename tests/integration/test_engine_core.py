"""EngineCore and the offline API on a tiny model: aborts, bad input, sampling options."""

from __future__ import annotations

from pathlib import Path

import pytest

from corefleet.engine import LLM, SamplingParams
from corefleet.engine.messages import EngineCoreRequest, FinishReason
from tests.fixtures_models import write_tiny_llama


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    folder = write_tiny_llama(tmp_path_factory.mktemp("tiny") / "m")
    # In-process: these tests reach into the EngineCore (tests/integration/test_engine_proc.py
    # covers the same engine behind the process boundary).
    return LLM(
        str(folder), multiprocess=False, dtype="float32", kv_cache_memory=8 << 20, block_size=4
    )


def test_abort_frees_blocks(llm: LLM) -> None:
    core = llm.engine_client.engine
    pool_free = core.scheduler.kv_cache_manager.num_free_blocks
    params = SamplingParams(max_tokens=100, ignore_eos=True, temperature=0.0)
    core.add_request(EngineCoreRequest("a", list(range(5, 40)), params))
    core.add_request(EngineCoreRequest("b", list(range(7, 20)), params))
    for _ in range(3):
        core.step()
    assert core.scheduler.kv_cache_manager.num_free_blocks < pool_free
    core.abort_requests(["a", "b"])
    core.step()  # the runner drops its state for finished requests
    assert not core.has_unfinished_requests()
    assert core.scheduler.kv_cache_manager.num_free_blocks == pool_free


def test_max_tokens_and_length_finish(llm: LLM) -> None:
    out = llm.generate(
        {"prompt_token_ids": [5, 6, 7]},
        SamplingParams(max_tokens=7, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert len(out.outputs[0].token_ids) == 7
    assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        (
            {"prompt_token_ids": list(range(5, 300))},
            SamplingParams(max_tokens=4),
            "maximum context length",
        ),
        ({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=300), "max_tokens=300"),
        ({"prompt_token_ids": [5, 99999]}, SamplingParams(), "outside the vocabulary"),
        ({"prompt_token_ids": []}, SamplingParams(), "empty"),
        ("hello", SamplingParams(temperature=-1.0), "temperature"),
        ("hello", SamplingParams(top_p=0.0), "top_p"),
        ("hello", SamplingParams(max_tokens=0), "max_tokens"),
        ("hello", SamplingParams(logprobs=50), "logprobs"),
    ],
)
def test_bad_input_is_refused_before_anything_runs(llm: LLM, prompt, params, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message):
        llm.generate(["fine prompt", prompt], params, use_tqdm=False)
    assert not llm.engine_client.engine.has_unfinished_requests()
    # The engine keeps serving.
    ok = llm.generate("hello", SamplingParams(max_tokens=3), use_tqdm=False)[0]
    assert len(ok.outputs[0].token_ids) == 3


def test_engine_refuses_a_too_long_prompt_itself(llm: LLM) -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        request = EngineCoreRequest("long", list(range(5, 300)), SamplingParams())
        llm.engine_client.engine.add_request(request)
    assert not llm.engine_client.engine.has_unfinished_requests()


def test_unknown_model_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does-not-exist"):
        LLM(str(tmp_path / "does-not-exist"))


def test_unknown_engine_argument() -> None:
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(max_num_seq=3)


def test_seeded_sampling_is_reproducible_and_n_samples_differ(llm: LLM) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, n=3, ignore_eos=True)
    first = llm.generate("hello there", params, use_tqdm=False)[0]
    # Same request again, now batched with unrelated work: same tokens.
    again = llm.generate(
        ["other", "hello there"], [SamplingParams(temperature=1.0), params], use_tqdm=False
    )[1]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1


def test_stop_string_truncates_and_aborts(llm: LLM) -> None:
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    full = llm.generate("hello", greedy, use_tqdm=False)[0].outputs[0]
    assert len(full.text) > 4
    stop = full.text[2:4]
    cut = llm.generate(
        "hello",
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[: full.text.index(stop)]
    assert not llm.engine_client.engine.has_unfinished_requests()


def test_logprobs_are_reported(llm: LLM) -> None:
    out = llm.generate(
        "hello", SamplingParams(max_tokens=4, temperature=0.0, logprobs=3), use_tqdm=False
    )[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 4
    for token_id, row in zip(out.token_ids, out.logprobs, strict=True):
        assert token_id in row
        assert row[token_id].rank == 1  # greedy picks the most likely token
        assert len(row) == 3  # the sampled token is also the top-1


def test_stop_token_ids_finish_with_stop(llm: LLM) -> None:
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    tokens = llm.generate("hello", greedy, use_tqdm=False)[0].outputs[0].token_ids
    stop_at = tokens[3]
    params = SamplingParams(
        max_tokens=10, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_at]
    )
    out = llm.generate("hello", params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tokens[: tokens.index(stop_at) + 1]
    assert out.finish_reason == str(FinishReason.STOP) and out.stop_reason == stop_at


def test_min_tokens_holds_back_stop_tokens(llm: LLM) -> None:
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    tokens = llm.generate("hello", greedy, use_tqdm=False)[0].outputs[0].token_ids
    stop_at = tokens[1]
    params = SamplingParams(
        max_tokens=10, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_at], min_tokens=6
    )
    out = llm.generate("hello", params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 6
    assert stop_at not in out.token_ids[:6]
