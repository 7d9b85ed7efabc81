"""Unit tests for the batched sampler: greedy/random draws, filters, seeds, penalties, logprobs."""

from __future__ import annotations

import pytest
import torch

from corefleet.engine.messages import SamplingParams
from corefleet.engine.worker.sampler import Sampler, apply_penalties
from tests.unit.sampler_helpers import build, seeded_gen


def sample_many(logits_row: torch.Tensor, params: SamplingParams, n: int) -> torch.Tensor:
    """Sample ``n`` independent draws of one distribution as one batch; returns counts [V]."""
    vocab = logits_row.shape[0]
    meta = build([params] * n, vocab)
    out = Sampler(seeded_gen(1234))(logits_row.expand(n, vocab).contiguous(), meta)
    return torch.bincount(torch.tensor(out.sampled_token_ids), minlength=vocab)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    return float(((counts.double() - expected) ** 2 / expected).sum())


# --- greedy and random sampling ----------------------------------------------------------


def test_greedy_equals_argmax_and_leaves_logits_untouched() -> None:
    logits = torch.randn(8, 50, generator=seeded_gen(0))
    before = logits.clone()
    out = Sampler()(logits, build([SamplingParams(temperature=0.0)] * 8, 50))
    assert out.sampled_token_ids == logits.argmax(dim=-1).tolist()
    assert out.token_ids_device.tolist() == out.sampled_token_ids
    assert out.logprobs == [None] * 8
    assert torch.equal(logits, before)


def test_logits_shape_must_match_metadata() -> None:
    meta = build([SamplingParams()] * 2, 10)
    with pytest.raises(ValueError, match="logits shape"):
        Sampler()(torch.zeros(3, 10), meta)
    with pytest.raises(ValueError, match="logits shape"):
        Sampler()(torch.zeros(2, 11), meta)


def test_empty_batch() -> None:
    out = Sampler()(torch.empty(0, 10), build([], 10))
    assert out.sampled_token_ids == [] and out.logprobs == []


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_matches_softmax_distribution(temperature: float) -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5])
    counts = sample_many(logits, SamplingParams(temperature=temperature), 30000)
    target = torch.softmax(logits / temperature, dim=-1)
    # Chi-square with 5 degrees of freedom: the 99.9% quantile is 20.5.
    assert chi_square(counts, target) < 20.5
    # The test has power: the wrong temperature is rejected by a wide margin.
    wrong = torch.softmax(logits / (temperature * 1.5), dim=-1)
    assert chi_square(counts, wrong) > 100


def test_top_k_restricts_support() -> None:
    logits = torch.randn(30, generator=seeded_gen(3))
    counts = sample_many(logits, SamplingParams(temperature=1.5, top_k=4), 4000)
    support = set(torch.nonzero(counts).flatten().tolist())
    assert support == set(logits.topk(4).indices.tolist())


@pytest.mark.parametrize(
    ("ks", "top_p"),
    # 0: no top-k in the same batch (partial-topk path, or full sort with top-p); all rows
    # under a top-k with top-p runs top-p inside the top max_top_k.
    [([2, 5, 0], 1.0), ([2, 5, 0], 0.99999), ([2, 5, 8], 0.99999)],
)
def test_top_k_differs_per_row(ks: list[int], top_p: float) -> None:
    vocab, n = 30, 3000
    logits = torch.randn(vocab, generator=seeded_gen(4))
    params = [SamplingParams(temperature=2.0, top_k=k, top_p=top_p) for k in ks] * n
    meta = build(params, vocab)
    out = Sampler(seeded_gen(8))(logits.expand(len(params), vocab).contiguous(), meta)
    ids = torch.tensor(out.sampled_token_ids).view(n, len(ks))
    for col, k in enumerate(ks):
        support = set(ids[:, col].tolist())
        assert support == set(logits.topk(k or vocab).indices.tolist())


PROBS = torch.tensor([0.05, 0.5, 0.15, 0.3])  # sorted: 1 (0.5), 3 (0.3), 2 (0.15), 0 (0.05)


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [(1e-9, {1}), (0.01, {1}), (0.45, {1}), (0.75, {1, 3}), (0.9, {1, 3, 2}), (1.0, {0, 1, 2, 3})],
)
def test_top_p_keeps_the_nucleus(top_p: float, expected: set[int]) -> None:
    counts = sample_many(PROBS.log(), SamplingParams(top_p=top_p), 4000)
    assert set(torch.nonzero(counts).flatten().tolist()) == expected


@pytest.mark.parametrize("with_plain_top_p_row", [False, True])
@pytest.mark.parametrize(
    ("top_k", "top_p", "expected"),
    # top-k 2 leaves {1: 0.625, 3: 0.375}: top-p 0.6 keeps token 1 only, 0.7 keeps both.
    [(2, 0.6, {1}), (2, 0.7, {1, 3}), (3, 0.99, {1, 2, 3}), (3, 1e-9, {1})],
)
def test_top_k_and_top_p_combine(
    top_k: int, top_p: float, expected: set[int], with_plain_top_p_row: bool
) -> None:
    # With every row under a top-k, top-p runs inside the top max_top_k; a companion row
    # without top-k forces the full-sort path instead. Both must agree.
    params = [SamplingParams(top_k=top_k, top_p=top_p)]
    if with_plain_top_p_row:
        params.append(SamplingParams(top_p=0.6))
    n = 3000
    meta = build(params * n, 4)
    assert meta.top_k_all_rows is not with_plain_top_p_row
    logits = PROBS.log().expand(n * len(params), 4).contiguous()
    out = Sampler(seeded_gen(2))(logits, meta)
    ids = torch.tensor(out.sampled_token_ids).view(n, len(params))
    assert set(ids[:, 0].tolist()) == expected
    if with_plain_top_p_row:
        assert set(ids[:, 1].tolist()) == {1, 3}


@pytest.mark.parametrize(("min_p", "expected"), [(0.2, {1, 2, 3}), (0.5, {1, 3}), (0.9, {1})])
def test_min_p_drops_unlikely_tokens(min_p: float, expected: set[int]) -> None:
    counts = sample_many(PROBS.log(), SamplingParams(min_p=min_p), 4000)
    assert set(torch.nonzero(counts).flatten().tolist()) == expected


def test_filtered_distribution_is_renormalized() -> None:
    counts = sample_many(PROBS.log(), SamplingParams(top_k=2), 20000)
    target = torch.tensor([0.0, 0.625, 0.0, 0.375])
    assert counts[0] == 0 and counts[2] == 0
    assert chi_square(counts[[1, 3]], target[[1, 3]]) < 10.8  # df 1, 99.9%


# --- seeds ---------------------------------------------------------------------------------


def run_seeded(
    vocab_logits: torch.Tensor, params: list[SamplingParams], steps: int, default_seed: int
) -> list[list[int]]:
    """Sample ``steps`` steps of a batch; returns per-row token lists."""
    gens = [seeded_gen(p.seed) if p.seed is not None else None for p in params]
    sampler = Sampler(seeded_gen(default_seed))
    tokens: list[list[int]] = [[] for _ in params]
    vocab = vocab_logits.shape[-1]
    for _ in range(steps):
        meta = build(params, vocab, generators=gens)
        out = sampler(vocab_logits.expand(len(params), vocab).contiguous(), meta)
        for row, tok in zip(tokens, out.sampled_token_ids, strict=True):
            row.append(tok)
    return tokens


def test_same_seed_same_tokens_regardless_of_batch() -> None:
    logits = torch.randn(500, generator=seeded_gen(7)) * 0.5  # flat: draws vary a lot
    seeded = SamplingParams(seed=42, temperature=0.9)
    alone = run_seeded(logits, [seeded], steps=6, default_seed=0)[0]
    assert alone == run_seeded(logits, [seeded], steps=6, default_seed=99)[0]
    # Same request at another row, among different requests and another default seed.
    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, top_k=50),
        SamplingParams(seed=7),
    ]
    batch = [others[0], others[1], seeded, others[2]]
    assert run_seeded(logits, batch, steps=6, default_seed=5)[2] == alone
    # And with a top-k row forcing the partial-topk path for the whole batch.
    batch = [others[1], seeded]
    assert run_seeded(logits, batch, steps=6, default_seed=6)[1] == alone


def test_different_seeds_differ() -> None:
    logits = torch.zeros(1000)
    params = [SamplingParams(seed=s) for s in (1, 2)]
    a, b = run_seeded(logits, params, steps=5, default_seed=0)
    assert a != b
    assert len(set(a)) > 1  # the generator advances between steps


# --- penalties -----------------------------------------------------------------------------


def test_penalties_match_hand_computation() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 1.0], [2.0, -1.0, 0.5, -0.5, 1.0]])
    params = [
        SamplingParams(repetition_penalty=2.0),
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
    ]
    outputs = [[1, 1], [0, 0, 0, 3]]
    prompts = [[0], [2]]
    meta = build(params, 5, outputs=outputs, prompts=prompts)
    got = apply_penalties(logits, meta)
    # Row 0: tokens 0 (prompt) and 1 (output) are seen: 2 / 2 = 1, -1 * 2 = -2.
    # Row 1: token 0 appears 3x: 2 - 0.5 * 3 - 0.25; token 3 once: -0.5 - 0.5 - 0.25;
    #        the prompt token 2 is not penalized by frequency/presence.
    expected = torch.tensor([[1.0, -2.0, 0.5, -0.5, 1.0], [0.25, -1.0, 0.5, -1.25, 1.0]])
    torch.testing.assert_close(got, expected)
    assert torch.equal(logits[0], torch.tensor([2.0, -1.0, 0.5, -0.5, 1.0]))  # not in place


def test_repetition_penalty_below_one_boosts_seen_tokens() -> None:
    logits = torch.tensor([[1.0, -2.0, 0.5]])
    meta = build([SamplingParams(repetition_penalty=0.5)], 3, outputs=[[0, 1]])
    torch.testing.assert_close(apply_penalties(logits, meta), torch.tensor([[2.0, -1.0, 0.5]]))


def test_penalties_steer_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0], [3.0, 2.9, 0.0]])
    params = [SamplingParams(temperature=0.0, presence_penalty=0.5), SamplingParams(temperature=0)]
    meta = build(params, 3, outputs=[[0], [0]])
    assert Sampler()(logits, meta).sampled_token_ids == [1, 0]


# --- logprobs ------------------------------------------------------------------------------


def test_logprobs_are_raw_sorted_and_ranked() -> None:
    logits = torch.randn(4, 40, generator=seeded_gen(11))
    params = [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=1.0, logprobs=3, frequency_penalty=2.0),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=0.0),
    ]
    outputs = [[], [int(logits[1].argmax())] * 3, [], []]
    meta = build(params, 40, generators=[None, seeded_gen(3), None, None], outputs=outputs)
    out = Sampler()(logits, meta)
    raw = torch.log_softmax(logits, dim=-1)
    for i, n in enumerate([5, 3, 0]):
        lp = out.logprobs[i]
        assert lp is not None
        assert len(lp.token_ids) == len(lp.logprobs) == len(lp.sampled_ranks) == 1
        ids, values = lp.token_ids[0], lp.logprobs[0]
        assert len(ids) == len(values) == n + 1
        tok = out.sampled_token_ids[i]
        assert ids[0] == tok
        # Raw model logprobs, unaffected by the penalty of row 1.
        assert values == pytest.approx(raw[i, ids].tolist(), abs=1e-6)
        assert ids[1:] == raw[i].topk(n).indices.tolist()
        assert values[1:] == sorted(values[1:], reverse=True)
        assert lp.sampled_ranks[0] == int((raw[i] > raw[i, tok]).sum()) + 1
    assert out.logprobs[0] is not None and out.logprobs[0].sampled_ranks == [1]  # greedy
    assert out.logprobs[3] is None


def test_logprob_rank_of_non_top_token() -> None:
    # The frequency penalty makes token 3 the greedy pick; ranks still use the raw logits.
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0]])
    params = [SamplingParams(temperature=0.0, frequency_penalty=2.0, logprobs=1)]
    meta = build(params, 4, outputs=[[0, 0, 1, 1, 2]])
    out = Sampler()(logits, meta)  # penalized: 1, 0, 1, 2 -> token 3
    lp = out.logprobs[0]
    assert out.sampled_token_ids == [3] and lp is not None
    assert lp.sampled_ranks == [4]
    assert lp.token_ids == [[3, 0]]
    assert lp.logprobs[0][0] == pytest.approx(float(torch.log_softmax(logits, -1)[0, 3]))


# --- mixed batches -------------------------------------------------------------------------


def test_mixed_batch_greedy_random_seeded() -> None:
    vocab = 200
    logits = torch.randn(5, vocab, generator=seeded_gen(21))
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=0.8, seed=3, top_p=0.9),
        SamplingParams(temperature=0.0, seed=4, logprobs=1),
        SamplingParams(temperature=2.0, min_p=0.05),
    ]
    gens: list[torch.Generator | None] = [None, None, seeded_gen(3), seeded_gen(4), None]
    out = Sampler(seeded_gen(0))(logits, build(params, vocab, generators=gens))
    ids = out.sampled_token_ids
    assert ids[0] == int(logits[0].argmax()) and ids[3] == int(logits[3].argmax())
    assert ids[1] in logits[1].topk(5).indices.tolist()
    probs4 = torch.softmax(logits[4] / 2.0, dim=-1)
    assert probs4[ids[4]] >= 0.05 * probs4.max()
    # The seeded row alone gives the same token.
    alone = Sampler(seeded_gen(9))(logits[2:3], build(params[2:3], vocab, [seeded_gen(3)]))
    assert alone.sampled_token_ids == [ids[2]]
    assert [lp is None for lp in out.logprobs] == [True, True, True, False, True]
