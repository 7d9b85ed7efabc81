"""Per-step sampling state of a batch, built once per step and consumed by :class:`Sampler`.

Everything the sampler needs is turned into a handful of device tensors here, so that the
sampler itself never touches Python per-request state except for seeded generators. Features
that no request in the batch uses are represented by ``None`` so that the common path (no
penalties, no top-k/top-p/min-p, no logprobs) does no extra work at all.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from corefleet.engine.messages import SamplingParams
from corefleet.engine.worker.token_controls import TokenControls

# Requests with a temperature below this are sampled greedily (same rule as SamplingParams).
_GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingMetadata:
    """Batched sampling parameters of one step; row ``i`` is the ``i``-th request.

    Tensors live on the logits' device. Rows that do not use a feature carry its neutral value
    (top_p 1, top_k ``vocab_size``, min_p 0, penalties 0/0/1), and greedy rows carry neutral
    values for every random-only feature, so one batched op serves the whole batch.
    """

    vocab_size: int
    all_greedy: bool
    all_random: bool
    # [B] float32; 1.0 on greedy rows so the batched division is harmless. None if all greedy.
    temperature: torch.Tensor | None
    # [B] bool, True on greedy rows; only set for mixed batches (else all_greedy/all_random).
    greedy_mask: torch.Tensor | None
    top_p: torch.Tensor | None  # [B] float32; None when no random row uses top-p
    top_k: torch.Tensor | None  # [B] int64; None when no random row uses top-k
    max_top_k: int  # largest active top-k (0 when none): lets the sampler use topk, not sort
    top_k_all_rows: bool  # every random row has a top-k: top-p can work inside the top max_top_k
    min_p: torch.Tensor | None  # [B] float32; None when no random row uses min-p
    # Row index -> the request's own generator (seeded random rows only).
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    no_penalties: bool = True
    # Each penalty kind is None unless some row uses it: [B] float32.
    presence_penalties: torch.Tensor | None = None
    frequency_penalties: torch.Tensor | None = None
    repetition_penalties: torch.Tensor | None = None
    # [B, V] float32: occurrences of each token among the request's generated tokens (rows that
    # use no penalty stay zero). Set whenever any penalty is used.
    output_token_counts: torch.Tensor | None = None
    # [B, V] bool: token appears in the prompt; only set when a row uses repetition penalty.
    prompt_token_mask: torch.Tensor | None = None
    # Per row: the requested number of top logprobs (None: the row wants no logprobs).
    num_logprobs: list[int | None] = field(default_factory=list)
    max_num_logprobs: int | None = None  # None when no row wants logprobs
    # Row -> the token ids whose logprobs it reports instead of its top-N (logprob_token_ids).
    logprob_token_ids: dict[int, list[int]] = field(default_factory=dict)
    # allowed_token_ids, bad words and logit_bias; None when no row uses any of them.
    token_controls: TokenControls | None = None

    @property
    def no_top_p(self) -> bool:
        return self.top_p is None

    @property
    def no_top_k(self) -> bool:
        return self.top_k is None

    @property
    def no_min_p(self) -> bool:
        return self.min_p is None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        output_token_ids: list[list[int]],
        prompt_token_ids: list[list[int]],
        vocab_size: int,
        device: torch.device,
    ) -> SamplingMetadata:
        """Build the metadata of one step.

        ``generators[i]`` is request ``i``'s own generator (on ``device``) if it has a seed,
        else None. Per-row values are gathered into Python lists and turned into tensors with
        one ``torch.tensor`` call per kind, so building is cheap for hundreds of requests.
        """
        _check_lengths(params, generators, output_token_ids, prompt_token_ids)
        greedy = [p.temperature < _GREEDY_TEMPERATURE for p in params]
        num_greedy = sum(greedy)
        num_logprobs = [_num_logprobs(p) for p in params]
        meta = cls(
            vocab_size=vocab_size,
            all_greedy=num_greedy == len(params),
            all_random=num_greedy == 0,
            # The random-only features start off: _build_random turns on those a row uses.
            temperature=None,
            greedy_mask=None,
            top_p=None,
            top_k=None,
            max_top_k=0,
            top_k_all_rows=False,
            min_p=None,
            num_logprobs=num_logprobs,
            max_num_logprobs=max((n for n in num_logprobs if n is not None), default=None),
            logprob_token_ids={
                i: p.logprob_token_ids for i, p in enumerate(params) if p.logprob_token_ids
            },
            token_controls=TokenControls.build(params, output_token_ids, vocab_size, device),
        )
        if not meta.all_greedy:
            meta._build_random(params, greedy, generators, device)
        meta._build_penalties(params, output_token_ids, prompt_token_ids, device)
        return meta

    def _build_random(
        self,
        params: list[SamplingParams],
        greedy: list[bool],
        generators: list[torch.Generator | None],
        device: torch.device,
    ) -> None:
        """Fill the tensors of the features only random rows use (the batch has such a row).

        Each of top-p, top-k and min-p stays None unless some random row uses it.
        """
        rows = _RandomRows.gather(params, greedy, generators, self.vocab_size)
        # One host->device copy for all float rows; the per-feature tensors are views.
        floats = torch.tensor(
            [rows.temperature, rows.top_p, rows.min_p], dtype=torch.float32, device=device
        )
        self.temperature = floats[0]  # [B]
        if any(tp < 1.0 for tp in rows.top_p):
            self.top_p = floats[1]  # [B]
        if any(mp > 0.0 for mp in rows.min_p):
            self.min_p = floats[2]  # [B]
        active_top_ks = [k for k in rows.top_k if k < self.vocab_size]
        if active_top_ks:
            self.top_k = torch.tensor(rows.top_k, dtype=torch.int64, device=device)  # [B]
            self.max_top_k = max(active_top_ks)
            # Greedy rows are neutral (k = V) but ignore the filtered logits anyway.
            self.top_k_all_rows = all(
                k < self.vocab_size for k, g in zip(rows.top_k, greedy, strict=True) if not g
            )
        if not self.all_random:
            self.greedy_mask = torch.tensor(greedy, dtype=torch.bool, device=device)  # [B]
        self.generators = rows.generators

    def _build_penalties(
        self,
        params: list[SamplingParams],
        output_token_ids: list[list[int]],
        prompt_token_ids: list[list[int]],
        device: torch.device,
    ) -> None:
        """Fill the penalty tensors, or leave ``no_penalties`` set when no row uses them.

        Each kind of penalty stays None unless some row uses it, so the sampler only pays for
        the kinds present in the batch.
        """
        presence = [p.presence_penalty for p in params]
        frequency = [p.frequency_penalty for p in params]
        repetition = [p.repetition_penalty for p in params]
        uses = [
            pr != 0.0 or fr != 0.0 or rp != 1.0
            for pr, fr, rp in zip(presence, frequency, repetition, strict=True)
        ]
        if not any(uses):
            return
        self.no_penalties = False
        pens = torch.tensor([presence, frequency, repetition], dtype=torch.float32, device=device)
        if any(pr != 0.0 for pr in presence):
            self.presence_penalties = pens[0]  # [B]
        if any(fr != 0.0 for fr in frequency):
            self.frequency_penalties = pens[1]  # [B]

        # Only rows that use a penalty contribute tokens: the others keep all-zero counts, which
        # leaves their logits untouched and keeps the scatter small.
        out_rows = [ids if u else [] for ids, u in zip(output_token_ids, uses, strict=True)]
        flat_idx = _flat_indices(out_rows, self.vocab_size, device)  # [N]
        counts = torch.zeros(len(params), self.vocab_size, device=device)  # [B, V] float32
        # Float atomics add exact small integers, so the result is deterministic on any device.
        counts.view(-1).index_add_(0, flat_idx, torch.ones_like(flat_idx, dtype=counts.dtype))
        self.output_token_counts = counts

        uses_rep = [rp != 1.0 for rp in repetition]
        if any(uses_rep):
            self.repetition_penalties = pens[2]  # [B]
            prompt_rows = [
                ids if r else [] for ids, r in zip(prompt_token_ids, uses_rep, strict=True)
            ]
            # A bool mask is all repetition needs: a quarter of the memory of counts.
            mask = torch.zeros(len(params), self.vocab_size, dtype=torch.bool, device=device)
            mask.view(-1)[_flat_indices(prompt_rows, self.vocab_size, device)] = True
            self.prompt_token_mask = mask  # [B, V]


def _num_logprobs(p: SamplingParams) -> int | None:
    """How many logprobs besides the sampled token's a row reports (vLLM's ``num_logprobs``)."""
    if p.logprobs is not None or not p.logprob_token_ids:
        return p.logprobs
    return len(p.logprob_token_ids)


def _check_lengths(
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    output_token_ids: list[list[int]],
    prompt_token_ids: list[list[int]],
) -> None:
    """Raise ValueError unless every per-request list has one entry per request."""
    num_reqs = len(params)
    if not (len(generators) == len(output_token_ids) == len(prompt_token_ids) == num_reqs):
        raise ValueError(
            "params, generators, output_token_ids and prompt_token_ids must have one entry "
            f"per request ({num_reqs}); got {len(generators)}, {len(output_token_ids)}, "
            f"{len(prompt_token_ids)}"
        )


@dataclass
class _RandomRows:
    """Per-row values of the features only random rows use; greedy rows carry neutral ones."""

    temperature: list[float]  # 1.0 on greedy rows
    top_p: list[float]  # 1.0 on greedy rows
    top_k: list[int]  # vocab_size on greedy rows and rows without a top-k below it
    min_p: list[float]  # 0.0 on greedy rows
    generators: dict[int, torch.Generator]  # row -> its own generator, seeded random rows only

    @classmethod
    def gather(
        cls,
        params: list[SamplingParams],
        greedy: list[bool],
        generators: list[torch.Generator | None],
        vocab_size: int,
    ) -> _RandomRows:
        """Read every row's values in one pass over the batch."""
        temps: list[float] = []
        top_ps: list[float] = []
        top_ks: list[int] = []
        min_ps: list[float] = []
        seeded: dict[int, torch.Generator] = {}
        for i, (p, is_greedy) in enumerate(zip(params, greedy, strict=True)):
            if is_greedy:
                temps.append(1.0)
                top_ps.append(1.0)
                top_ks.append(vocab_size)
                min_ps.append(0.0)
                continue
            temps.append(p.temperature)
            top_ps.append(p.top_p)
            top_ks.append(p.top_k if 0 < p.top_k < vocab_size else vocab_size)
            min_ps.append(p.min_p)
            gen = generators[i]
            if gen is not None:
                seeded[i] = gen
        return cls(temps, top_ps, top_ks, min_ps, seeded)


def _flat_indices(rows: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Return ``[N]`` int64 indices ``row * V + token`` into a flattened ``[B, V]`` tensor.

    Flattening avoids padding every row to the longest one; numpy builds the index in a few
    vectorized passes and it crosses to the device in one copy.
    """
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))  # [B]
    total = int(lengths.sum())
    tokens = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=total)  # [N]
    if total and not (tokens.min() >= 0 and tokens.max() < vocab_size):
        # An out-of-range id would silently land in the neighbouring row's slice.
        raise ValueError(f"token ids must be in [0, {vocab_size}) for penalties")
    row_offsets = np.repeat(np.arange(len(rows), dtype=np.int64) * vocab_size, lengths)  # [N]
    return torch.from_numpy(tokens + row_offsets).to(device)
