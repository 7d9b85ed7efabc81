"""Batched token sampler: penalties, greedy/random sampling, top-k/top-p/min-p and logprobs.

All math runs in torch on the logits' device; the only device->host transfer is one copy of
the step's results at the end. Order of operations follows vLLM v1:

1. logprobs to report, from the raw model logits (before penalties and temperature): each
   row's top-N, or the tokens its ``logprob_token_ids`` name;
2. token-level controls: tokens outside ``allowed_token_ids`` and those a bad word bans to
   ``-inf``, then ``logit_bias`` added;
3. repetition, frequency and presence penalties;
4. the grammar's mask (structured outputs): disallowed tokens of constrained rows to ``-inf``;
5. greedy rows: argmax; random rows: temperature, min-p, top-k, top-p, then an exponential-race
   draw (``argmax(probs / q)`` with ``q ~ Exp(1)``), each seeded row from its own generator.

The caller's logits tensor is never modified.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from corefleet.engine.messages import Logprobs
from corefleet.engine.worker.sampling_metadata import SamplingMetadata

__all__ = [
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "apply_grammar_mask",
    "apply_min_p",
    "apply_penalties",
    "apply_top_k_top_p",
    "compute_logprobs",
    "random_sample",
]


@dataclass
class SamplerOutput:
    """One step's sampled tokens; row ``i`` belongs to request ``i`` of the metadata."""

    sampled_token_ids: list[int]  # [B], on the host
    # Per row: one new-token row (sampled token, then its top-N), or None if not requested.
    logprobs: list[Logprobs | None]
    token_ids_device: torch.Tensor  # [B] int64, same values, still on the logits' device


class Sampler:
    """Samples one token per row of a ``[B, V]`` logits tensor.

    ``generator`` is the shared generator of unseeded random rows (it must live on the logits'
    device); None uses torch's default generator for that device. ``argmax`` is the row-wise
    argmax both greedy and random sampling end in (the kernel backend's; torch's by default).
    """

    def __init__(
        self,
        generator: torch.Generator | None = None,
        argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.generator = generator
        self.argmax = argmax or _torch_argmax

    def __call__(
        self,
        logits: torch.Tensor,
        meta: SamplingMetadata,
        banned: tuple[torch.Tensor | None, torch.Tensor] | None = None,
    ) -> SamplerOutput:
        """Sample from ``logits`` (``[B, V]``, float32) as ``meta`` says.

        ``banned``: ``(rows [K] int64 or None for all rows, mask [K, V] bool)``, the tokens a
        grammar forbids on those rows; the other rows are untouched.
        """
        expected = (len(meta.num_logprobs), meta.vocab_size)
        if tuple(logits.shape) != expected:
            # Shapes are host metadata: checking them costs no device sync.
            raise ValueError(f"logits shape {tuple(logits.shape)} != metadata's {expected}")
        logits = logits.float()  # no-op for float32; the math below assumes it
        # Reported logprobs are the model's own distribution, as in vLLM's default "raw" mode.
        raw_logprobs = compute_logprobs(logits) if meta.max_num_logprobs is not None else None
        if meta.token_controls is not None:
            logits = meta.token_controls.apply(logits)
        if not meta.no_penalties:
            logits = apply_penalties(logits, meta)
        if banned is not None:
            logits = apply_grammar_mask(logits, *banned)
        sampled = self.sample(logits, meta)  # [B] int64
        return _to_output(sampled, raw_logprobs, meta)

    def sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Return ``[B]`` int64 token ids from (already penalized) ``[B, V]`` logits."""
        if meta.all_greedy:
            return self.argmax(logits)  # [B]
        greedy_ids = None if meta.all_random else self.argmax(logits)  # [B]
        assert meta.temperature is not None

        # Division allocates a fresh tensor: everything below may work in place on it.
        logits = logits / meta.temperature.unsqueeze(1)  # [B, V]
        if meta.min_p is not None:
            logits = apply_min_p(logits, meta.min_p)
        if meta.top_k is not None or meta.top_p is not None:
            logits = apply_top_k_top_p(
                logits, meta.top_k, meta.top_p, meta.max_top_k, meta.top_k_all_rows
            )
        probs = logits.softmax(dim=-1)  # [B, V]
        random_ids = random_sample(probs, meta.generators, self.generator, self.argmax)  # [B]

        if greedy_ids is None:
            return random_ids
        assert meta.greedy_mask is not None
        return torch.where(meta.greedy_mask, greedy_ids, random_ids)


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """Return ``[B, V]`` float32 log-probabilities of ``[B, V]`` logits."""
    return torch.log_softmax(logits.float(), dim=-1)


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Return new ``[B, V]`` logits with repetition, frequency and presence penalties applied.

    Repetition (HF/vLLM): for tokens seen in the prompt or output, positive logits are divided
    by the penalty and negative ones multiplied by it. Frequency subtracts ``penalty * count``
    and presence subtracts ``penalty * (count > 0)``, counting generated tokens only.
    """
    counts = meta.output_token_counts  # [B, V]
    assert counts is not None
    in_output = counts > 0  # [B, V]

    if meta.repetition_penalties is not None:
        seen = in_output if meta.prompt_token_mask is None else in_output | meta.prompt_token_mask
        rep = meta.repetition_penalties.unsqueeze(1)  # [B, 1]
        # Rows without a repetition penalty have rep == 1, so they pass through unchanged.
        penalized = torch.where(logits > 0, logits / rep, logits * rep)  # [B, V]
        logits = torch.where(seen, penalized, logits)
    if meta.frequency_penalties is not None:
        logits = torch.addcmul(logits, meta.frequency_penalties.unsqueeze(1), counts, value=-1.0)
    if meta.presence_penalties is not None:
        logits = torch.addcmul(logits, meta.presence_penalties.unsqueeze(1), in_output, value=-1.0)
    return logits


def apply_grammar_mask(
    logits: torch.Tensor, rows: torch.Tensor | None, banned: torch.Tensor
) -> torch.Tensor:
    """Return new ``[B, V]`` logits with each of ``rows``' ``banned`` ``[K, V]`` tokens at
    ``-inf``; ``rows`` None means every row, in order (one pass, the common case)."""
    if rows is None:
        return logits.masked_fill(banned, float("-inf"))
    masked = logits[rows].masked_fill_(banned, float("-inf"))  # [K, V], a copy
    return logits.index_copy(0, rows, masked)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask (in place) tokens whose probability is below ``min_p`` times the row's best.

    ``p_i < min_p * p_max`` is ``logit_i - logit_max < log(min_p)``, which needs no softmax;
    ``min_p == 0`` gives ``-inf`` and masks nothing.
    """
    max_logit = logits.amax(dim=-1, keepdim=True)  # [B, 1]
    threshold = max_logit + torch.log(min_p).unsqueeze(1)  # [B, 1]
    return logits.masked_fill_(logits < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    max_top_k: int,
    top_k_all_rows: bool = False,
) -> torch.Tensor:
    """Mask tokens outside each row's top-k and top-p nucleus; may reuse ``logits``' storage.

    ``top_k`` is ``[B]`` with ``V`` on rows without top-k; ``top_p`` is ``[B]`` with 1.0 on rows
    without top-p. ``max_top_k`` is the largest active k; ``top_k_all_rows`` says every row
    that matters has a top-k. Top-p keeps the smallest set of best tokens whose probability
    sums to at least ``top_p`` (after top-k), and always keeps the best token.
    """
    vocab_size = logits.shape[-1]
    if top_k is None and top_p is None:
        return logits
    if top_k is not None and (top_p is None or top_k_all_rows):
        # A partial topk over the largest k in the batch is far cheaper than a full sort.
        k = min(max_top_k, vocab_size)
        top_vals, top_idx = logits.topk(k, dim=-1)  # [B, k] descending
        row_k = top_k.clamp(max=k).unsqueeze(1)  # [B, 1]
        if top_p is None:
            kth = top_vals.gather(1, row_k - 1)  # [B, 1]
            # Rows without top-k (top_k == V > k) keep everything.
            kth.masked_fill_((top_k > k).unsqueeze(1), float("-inf"))
            return logits.masked_fill_(logits < kth, float("-inf"))
        # Every row keeps at most k tokens, so its nucleus lies inside its top k.
        top_vals.masked_fill_(torch.arange(k, device=logits.device) >= row_k, float("-inf"))
        probs = top_vals.softmax(dim=-1)  # [B, k]
        # Drop a token once the strictly better ones already hold top_p; the best never is.
        drop = probs.cumsum(dim=-1) - probs >= top_p.unsqueeze(1)  # [B, k]
        top_vals.masked_fill_(drop, float("-inf"))
        return torch.full_like(logits, float("-inf")).scatter_(1, top_idx, top_vals)

    assert top_p is not None  # the branches above handle every other case
    sorted_logits, sorted_idx = logits.sort(dim=-1)  # [B, V] ascending
    if top_k is not None:
        # Position V - k holds the k-th largest value; top_k == V selects the smallest (no-op).
        kth = sorted_logits.gather(1, (vocab_size - top_k).clamp(min=0).unsqueeze(1))  # [B, 1]
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    cum_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [B, V] ascending mass
    # Dropping token i (and everything below it) still leaves >= top_p of the mass above it.
    drop = cum_probs <= (1.0 - top_p).unsqueeze(1)  # [B, V]
    drop[:, -1] = False  # the best token always survives rounding
    sorted_logits.masked_fill_(drop, float("-inf"))
    return logits.scatter_(1, sorted_idx, sorted_logits)


def random_sample(
    probs: torch.Tensor,
    generators: dict[int, torch.Generator],
    default_generator: torch.Generator | None = None,
    argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Draw one token per row of ``[B, V]`` probs: ``argmax(probs / q)``, ``q ~ Exp(1)``.

    This exponential race samples exactly from ``probs`` without a CPU sync or a cumulative
    sum. Seeded rows redraw their ``q`` from their own generator, so their tokens depend only
    on their own seed and history, never on the batch they share.
    """
    q = torch.empty_like(probs)  # [B, V]
    q.exponential_(generator=default_generator)
    for row, gen in generators.items():
        q[row].exponential_(generator=gen)
    # q can be exactly 0; clamping keeps masked tokens at 0 / tiny = 0 instead of 0 / 0 = nan.
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return (argmax or _torch_argmax)(probs.div_(q))


def _reported_ids(raw_logprobs: torch.Tensor, num_top: int, meta: SamplingMetadata) -> torch.Tensor:
    """``[B, N]`` int64: the tokens whose logprobs each row reports besides the sampled one:
    its top-N (descending), or the first entries are the ids its ``logprob_token_ids`` name,
    in their order (every such list fits: N is the batch's largest count)."""
    chosen = meta.logprob_token_ids
    wants_top = any(n is not None and i not in chosen for i, n in enumerate(meta.num_logprobs))
    if wants_top:
        top_ids = raw_logprobs.topk(num_top, dim=-1).indices  # [B, N]
    else:  # every row names its tokens: no top-k to compute
        top_ids = torch.zeros(
            raw_logprobs.shape[0], num_top, dtype=torch.int64, device=raw_logprobs.device
        )
    if chosen:
        rows = [row for row, ids in chosen.items() for _ in ids]
        cols = [col for ids in chosen.values() for col in range(len(ids))]
        values = [t for ids in chosen.values() for t in ids]
        index = torch.tensor([rows, cols, values], dtype=torch.int64, device=top_ids.device)
        top_ids[index[0], index[1]] = index[2]
    return top_ids


def _torch_argmax(x: torch.Tensor) -> torch.Tensor:  # [B, V] -> [B] int64
    return x.argmax(dim=-1)


def _to_output(
    sampled: torch.Tensor, raw_logprobs: torch.Tensor | None, meta: SamplingMetadata
) -> SamplerOutput:
    """Move the step's results to the host in a single copy and split them per row."""
    num_reqs = sampled.shape[0]
    if raw_logprobs is None or meta.max_num_logprobs is None:
        return SamplerOutput(sampled.tolist(), [None] * num_reqs, sampled)

    num_top = min(meta.max_num_logprobs, raw_logprobs.shape[-1])
    sampled_lp = raw_logprobs.gather(1, sampled.unsqueeze(1))  # [B, 1]
    # Rank 1 is the best token; ties with the sampled token share its rank.
    ranks = (raw_logprobs > sampled_lp).sum(dim=-1, keepdim=True) + 1  # [B, 1]
    ids = sampled.unsqueeze(1)  # [B, 1]
    lps = sampled_lp
    if num_top > 0:
        top_ids = _reported_ids(raw_logprobs, num_top, meta)  # [B, N]
        ids = torch.cat([ids, top_ids], dim=1)  # [B, N + 1]
        lps = torch.cat([lps, raw_logprobs.gather(1, top_ids)], dim=1)  # [B, N + 1]
    # Token ids and ranks are exact in float64 (< 2**53) and float32 logprobs widen exactly,
    # so one packed tensor carries everything across in one transfer.
    packed = torch.cat([ids.double(), lps.double(), ranks.double()], dim=1).cpu()  # [B, 2N+3]
    rows: list[list[float]] = packed.tolist()

    width = num_top + 1
    token_ids: list[int] = []
    logprobs: list[Logprobs | None] = []
    for row, n in zip(rows, meta.num_logprobs, strict=True):
        token_ids.append(int(row[0]))
        if n is None:
            logprobs.append(None)
            continue
        keep = min(n, num_top) + 1
        logprobs.append(
            Logprobs(
                token_ids=[[int(t) for t in row[:keep]]],
                logprobs=[row[width : width + keep]],
                sampled_ranks=[int(row[-1])],
            )
        )
    return SamplerOutput(token_ids, logprobs, sampled)
