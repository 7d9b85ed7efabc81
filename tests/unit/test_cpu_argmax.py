"""The C++ row-wise argmax (``corefleet_cpu.argmax_rows``) against ``torch.argmax``."""

from __future__ import annotations

import pytest
import torch

from corefleet.engine.messages import SamplingParams
from corefleet.engine.worker.sampler import Sampler
from corefleet.engine.worker.sampling_metadata import SamplingMetadata
from corefleet.kernels.cpu import backend as cpu_backend
from tests.cpu_ops_support import load_cpu_ops_or_skip

OPS = load_cpu_ops_or_skip()
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
# Shorter than, equal to and past one 16-lane chunk, a ragged tail, SmolLM2's vocabulary.
@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 1000, 49152])
def test_random_rows_match_torch(dtype: torch.dtype, vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(9, vocab, generator=gen).to(dtype)
    assert torch.equal(OPS.argmax_rows(logits), logits.argmax(dim=-1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_take_the_first_maximum(dtype: torch.dtype) -> None:
    logits = torch.zeros(4, 40, dtype=dtype)
    logits[0, [3, 20, 35]] = 5.0  # in a chunk, a later chunk and the tail
    logits[1, [33, 37]] = 5.0  # the tail only
    logits[2, [17, 18]] = 5.0  # neighbours in one chunk
    logits[3] = float("-inf")  # nothing finite: index 0
    actual = OPS.argmax_rows(logits)
    assert actual.tolist() == [3, 33, 17, 0]
    assert torch.equal(actual, logits.argmax(dim=-1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_wins_as_in_torch(dtype: torch.dtype) -> None:
    logits = torch.randn(3, 50).to(dtype)
    logits[0, 7] = float("nan")  # in a full chunk
    logits[1, 49] = float("nan")  # in the tail
    logits[2, [40, 9]] = float("nan")  # two: the first counts
    actual = OPS.argmax_rows(logits)
    assert actual.tolist() == [7, 49, 9]
    assert torch.equal(actual, logits.argmax(dim=-1))


def test_strided_rows_and_empty_batch() -> None:
    wide = torch.randn(5, 300)
    view = wide[:, 10:250]  # rows 300 apart, 240 long
    assert torch.equal(OPS.argmax_rows(view), view.argmax(dim=-1))
    assert OPS.argmax_rows(torch.empty(0, 10)).shape == (0,)


def test_rejects_bad_input() -> None:
    with pytest.raises(RuntimeError, match="must be \\[B, V\\]"):
        OPS.argmax_rows(torch.zeros(4))
    with pytest.raises(RuntimeError, match="float32 and bfloat16"):
        OPS.argmax_rows(torch.zeros(2, 3, dtype=torch.float64))


def test_sampler_on_the_cpu_backend_matches_torch() -> None:
    """Greedy and seeded random rows give the same tokens with the op as with torch.argmax."""
    backend = cpu_backend.CpuBackend()
    params = [SamplingParams(temperature=0.0)] * 3 + [
        SamplingParams(temperature=0.8, top_p=0.9, seed=s) for s in range(5)
    ]
    logits = torch.randn(len(params), 49152, generator=torch.Generator().manual_seed(0))

    def sample(argmax: object) -> list[int]:
        meta = SamplingMetadata.build(
            params=params,
            generators=[
                None if p.seed is None else torch.Generator().manual_seed(p.seed) for p in params
            ],
            output_token_ids=[[] for _ in params],
            prompt_token_ids=[[] for _ in params],
            vocab_size=49152,
            device=torch.device("cpu"),
        )
        sampler = Sampler(torch.Generator().manual_seed(1), argmax=argmax)  # type: ignore[arg-type]
        return sampler(logits.clone(), meta).sampled_token_ids

    assert sample(backend.argmax) == sample(None)
