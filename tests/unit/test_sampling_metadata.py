"""SamplingParams validation and the per-step SamplingMetadata built from a batch of them."""

from __future__ import annotations

import pytest

from corefleet.engine.messages import SamplingParams
from corefleet.engine.worker.sampling_metadata import SamplingMetadata
from tests.unit.sampler_helpers import CPU, build, seeded_gen

# --- metadata --------------------------------------------------------------------------------


def test_all_greedy_metadata_takes_the_fast_path() -> None:
    meta = build([SamplingParams(temperature=0.0, top_k=5, top_p=0.5)] * 3, 10)
    assert meta.all_greedy and not meta.all_random
    assert meta.temperature is None and meta.greedy_mask is None
    # Random-only knobs of greedy requests are irrelevant and must not cost anything.
    assert meta.no_top_k and meta.no_top_p and meta.no_min_p
    assert meta.no_penalties and meta.output_token_counts is None
    assert meta.max_num_logprobs is None


def test_metadata_flags_and_tensors() -> None:
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.5, top_k=3, logprobs=2),
        SamplingParams(temperature=1.0, top_p=0.9, min_p=0.1, logprobs=0),
    ]
    meta = build(params, 10, generators=[seeded_gen(0), seeded_gen(1), None])
    assert not meta.all_greedy and not meta.all_random
    assert meta.greedy_mask is not None and meta.greedy_mask.tolist() == [True, False, False]
    assert meta.temperature is not None and meta.temperature.tolist() == [1.0, 0.5, 1.0]
    assert meta.top_k is not None and meta.top_k.tolist() == [10, 3, 10]
    assert meta.max_top_k == 3
    assert meta.top_p is not None and meta.top_p.tolist() == pytest.approx([1.0, 1.0, 0.9])
    assert meta.min_p is not None and meta.min_p.tolist() == pytest.approx([0.0, 0.0, 0.1])
    assert list(meta.generators) == [1]  # the greedy row's generator is never used
    assert meta.num_logprobs == [None, 2, 0] and meta.max_num_logprobs == 2
    assert meta.no_penalties


def test_metadata_penalty_counts() -> None:
    params = [
        SamplingParams(frequency_penalty=0.5),
        SamplingParams(),
        SamplingParams(repetition_penalty=1.5),
    ]
    outputs = [[1, 1, 3], [2, 2], [4]]
    prompts = [[0], [0], [5, 5]]
    meta = build(params, 6, outputs=outputs, prompts=prompts)
    assert not meta.no_penalties
    assert meta.output_token_counts is not None and meta.prompt_token_mask is not None
    # Row 1 uses no penalty, so its tokens are not even counted.
    assert meta.output_token_counts.tolist() == [
        [0, 2, 0, 1, 0, 0],
        [0, 0, 0, 0, 0, 0],
        [0, 0, 0, 0, 1, 0],
    ]
    assert meta.prompt_token_mask.tolist() == [[False] * 6, [False] * 6, [False] * 5 + [True]]
    # Only the kinds in use are materialized.
    assert meta.presence_penalties is None
    assert meta.frequency_penalties is not None and meta.repetition_penalties is not None


def test_metadata_rejects_out_of_range_penalty_tokens() -> None:
    with pytest.raises(ValueError, match="token ids"):
        build([SamplingParams(presence_penalty=1.0)], 6, outputs=[[6]])


def test_metadata_rejects_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="one entry per request"):
        SamplingMetadata.build([SamplingParams()], [], [[]], [[]], 10, CPU)


# --- SamplingParams.validate -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"logprobs": 21}, "logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 3}, "min_tokens"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ],
)
def test_validate_rejects_invalid_values(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ValueError, match=rf"\b{field}="):
        SamplingParams(**kwargs).validate()


def test_validate_accepts_defaults_and_edges() -> None:
    SamplingParams().validate()
    SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, min_p=1.0, logprobs=20).validate()
