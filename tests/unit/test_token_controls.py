"""Token-level controls in the sampler: logit_bias, allowed_token_ids, bad words and
logprob_token_ids, alone, in mixed batches, and with penalties, grammars and seeds."""

from __future__ import annotations

import torch

from corefleet.engine.messages import SamplingParams
from corefleet.engine.token_controls import bad_word_bans, tokenize_bad_words
from corefleet.engine.worker.sampler import Sampler
from tests.unit.sampler_helpers import build, seeded_gen

V = 32
GREEDY = SamplingParams(temperature=0.0)


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=seeded_gen(seed))  # [rows, V]


def test_no_controls_build_nothing() -> None:
    assert build([SamplingParams(), GREEDY], V).token_controls is None


def test_a_bias_of_100_makes_greedy_pick_the_token() -> None:
    x = logits(1)
    least = int(x[0].argmin())
    params = SamplingParams(temperature=0.0, logit_bias={least: 100.0})
    assert Sampler()(x, build([params], V)).sampled_token_ids == [least]


def test_a_bias_of_minus_100_bans_the_best_token_and_values_are_clamped() -> None:
    x = logits(1)
    best, second = x[0].topk(2).indices.tolist()
    params = SamplingParams(temperature=0.0, logit_bias={best: -100.0})
    assert Sampler()(x, build([params], V)).sampled_token_ids == [second]
    # Clamped: a bias of 1e6 counts as 100, which leaves token 5 (100) below token 3 (150).
    y = torch.zeros(1, V)
    y[0, 3] = 150.0
    clamped = SamplingParams(temperature=0.0, logit_bias={5: 1e6})
    assert Sampler()(y, build([clamped], V)).sampled_token_ids == [3]


def test_allowed_token_ids_restrict_random_sampling() -> None:
    rows = 400
    x = torch.zeros(rows, V)  # uniform: any token is as likely as another
    params = SamplingParams(temperature=1.0, allowed_token_ids=[2, 7, 30])
    out = Sampler(seeded_gen(1))(x, build([params] * rows, V))
    assert set(out.sampled_token_ids) == {2, 7, 30}


def test_allowed_token_ids_with_greedy_pick_the_best_allowed() -> None:
    x = logits(1)
    order = x[0].argsort(descending=True).tolist()
    params = SamplingParams(temperature=0.0, allowed_token_ids=[order[5], order[9]])
    assert Sampler()(x, build([params], V)).sampled_token_ids == [order[5]]


def test_mixed_batch_only_changes_the_rows_that_ask_and_leaves_logits_untouched() -> None:
    x = logits(4)
    before = x.clone()
    least = x.argmin(dim=-1).tolist()
    params = [
        GREEDY,
        SamplingParams(temperature=0.0, logit_bias={least[1]: 100.0}),
        SamplingParams(temperature=0.0, allowed_token_ids=[least[2]]),
        GREEDY,
    ]
    out = Sampler()(x, build(params, V))
    argmax = x.argmax(dim=-1).tolist()
    assert out.sampled_token_ids == [argmax[0], least[1], least[2], argmax[3]]
    assert torch.equal(x, before)


def test_controls_compose_with_the_grammar_mask() -> None:
    x = torch.zeros(2, V)
    x[:, 4] = 5.0  # the favourite, which allowed_token_ids leaves out
    x[:, 1] = 3.0
    banned = torch.zeros(1, V, dtype=torch.bool)
    banned[0, 1] = True  # the grammar forbids 1 on row 1 only
    params = SamplingParams(temperature=0.0, allowed_token_ids=[1, 2])
    out = Sampler()(x, build([params, params], V), (torch.tensor([1]), banned))
    assert out.sampled_token_ids == [1, 2]


def test_bias_applies_before_penalties() -> None:
    # vLLM's order: the bias first, then the repetition penalty divides the biased logit.
    x = torch.zeros(1, V)
    x[0, 0] = 1.0
    params = SamplingParams(temperature=0.0, logit_bias={9: 3.0}, repetition_penalty=2.0)
    out = Sampler()(x, build([params], V, outputs=[[9]]))
    # 9: (0 + 3) / 2 = 1.5 > 1.0: still the best after the penalty.
    assert out.sampled_token_ids == [9]
    strong = SamplingParams(temperature=0.0, logit_bias={9: 1.5}, repetition_penalty=2.0)
    # 9: 1.5 / 2 = 0.75 < 1.0: the penalty, applied after the bias, hands it back to 0.
    assert Sampler()(x, build([strong], V, outputs=[[9]])).sampled_token_ids == [0]


def test_seeded_rows_with_controls_do_not_depend_on_the_batch() -> None:
    x = torch.zeros(3, V)
    seeded = SamplingParams(temperature=1.0, seed=7, allowed_token_ids=list(range(0, V, 2)))
    alone = Sampler(seeded_gen(1))(x[:1], build([seeded], V, [seeded_gen(7)]))
    others = [SamplingParams(temperature=1.0, logit_bias={3: 50.0}), GREEDY]
    mixed = Sampler(seeded_gen(2))(
        x, build([others[0], seeded, others[1]], V, [None, seeded_gen(7), None])
    )
    assert mixed.sampled_token_ids[1] == alone.sampled_token_ids[0]
    assert mixed.sampled_token_ids[0] == 3
    assert alone.sampled_token_ids[0] % 2 == 0


def test_reported_logprobs_are_the_raw_ones() -> None:
    # As vLLM's default raw_logprobs mode: the bias changes the choice, not the reported logprob.
    x = logits(1)
    least = int(x[0].argmin())
    params = SamplingParams(temperature=0.0, logit_bias={least: 100.0}, logprobs=1)
    (row,) = Sampler()(x, build([params], V)).logprobs
    assert row is not None
    raw = torch.log_softmax(x[0], dim=-1)
    assert row.token_ids[0][0] == least
    assert abs(row.logprobs[0][0] - float(raw[least])) < 1e-5
    assert row.sampled_ranks == [V]


def test_logprob_token_ids_report_exactly_those_tokens_next_to_a_top_n_row() -> None:
    x = logits(2)
    named = [17, 3, 25]
    params = [
        SamplingParams(temperature=0.0, logprob_token_ids=named),
        SamplingParams(temperature=0.0, logprobs=2),
    ]
    meta = build(params, V)
    assert meta.num_logprobs == [3, 2]
    first, second = Sampler()(x, meta).logprobs
    assert first is not None and second is not None
    raw = torch.log_softmax(x, dim=-1)
    best = x.argmax(dim=-1).tolist()
    assert first.token_ids == [[best[0], *named]]
    expected = raw[0, [best[0], *named]].tolist()
    assert all(abs(a - b) < 1e-5 for a, b in zip(first.logprobs[0], expected, strict=True))
    assert first.sampled_ranks == [1]
    assert second.token_ids == [[best[1], *raw[1].topk(2).indices.tolist()]]


def test_bad_words_ban_the_last_token_after_the_rest_of_the_word() -> None:
    sequences = [[3], [4, 5], [6, 7, 8]]
    assert bad_word_bans(sequences, []) == [3]
    assert bad_word_bans(sequences, [1, 4]) == [3, 5]
    assert bad_word_bans(sequences, [6, 7]) == [3, 8]
    assert bad_word_bans(sequences, [7]) == [3]


def test_bad_words_steer_greedy_sampling_per_row() -> None:
    x = torch.zeros(2, V)
    x[:, 5] = 2.0
    x[:, 6] = 1.0
    params = SamplingParams(temperature=0.0, bad_words_token_ids=[[4, 5]])
    out = Sampler()(x, build([params, params], V, outputs=[[4], [9]]))
    assert out.sampled_token_ids == [6, 5]  # 5 is banned only right after 4


def test_tokenize_bad_words_adds_the_spaced_form_when_it_differs() -> None:
    vocab = {"bad": [1], " bad": [2], "two words": [3, 4], " two words": [5, 4], "x": [6]}
    vocab[" x"] = [6]  # the same token with or without a space: listed once

    def encode(text: str) -> list[int]:
        return vocab[text]

    assert tokenize_bad_words(["bad", "  two words", "x"], encode) == [
        [1],
        [2],
        [3, 4],
        [5, 4],
        [6],
    ]
