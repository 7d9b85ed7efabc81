"""A batch's token-level controls as device tensors: ``allowed_token_ids``, ``bad_words`` and
``logit_bias`` (vLLM's), applied to the logits before the penalties.

Built per step only when some row uses one of them (the metadata's field is None otherwise, so
batches that use none pay nothing); each kind is None unless some row uses it, and a row that
does not use a kind is left untouched by it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from corefleet.engine.messages import SamplingParams
from corefleet.engine.token_controls import MAX_ABS_LOGIT_BIAS, bad_word_bans


def uses_token_controls(p: SamplingParams) -> bool:
    return bool(p.logit_bias or p.allowed_token_ids or p.bad_words_token_ids)


@dataclass
class TokenControls:
    """Row ``i`` is the batch's ``i``-th request."""

    # [B, V] bool: True on the tokens a row's allowed_token_ids leave out (False on rows
    # without the parameter).
    disallowed: torch.Tensor | None
    # The tokens a bad word bans on this step: (rows [N] int64, token ids [N] int64).
    bad_words: tuple[torch.Tensor, torch.Tensor] | None
    # logit_bias entries: (rows [M] int64, token ids [M] int64, biases [M] float32).
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        output_token_ids: Sequence[Sequence[int]],
        vocab_size: int,
        device: torch.device,
    ) -> TokenControls | None:
        """The batch's controls, or None when no row uses any (the common case)."""
        if not any(uses_token_controls(p) for p in params):
            return None
        return cls(
            _disallowed(params, vocab_size, device),
            _bad_word_bans(params, output_token_ids, device),
            _bias(params, device),
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Return new ``[B, V]`` logits with the controls applied; ``logits`` is untouched.

        Bans come first and give ``-inf``, which a bias leaves at ``-inf`` (vLLM's order:
        allowed tokens, bad words, then the bias).
        """
        logits = logits.clone()
        if self.disallowed is not None:
            logits.masked_fill_(self.disallowed, float("-inf"))
        if self.bad_words is not None:
            logits.index_put_(self.bad_words, torch.tensor(float("-inf"), device=logits.device))
        if self.bias is not None:
            rows, ids, values = self.bias
            logits.index_put_((rows, ids), values, accumulate=True)
        return logits


def _disallowed(
    params: Sequence[SamplingParams], vocab_size: int, device: torch.device
) -> torch.Tensor | None:
    rows = [i for i, p in enumerate(params) if p.allowed_token_ids]
    if not rows:
        return None
    mask = torch.zeros(len(params), vocab_size, dtype=torch.bool, device=device)  # [B, V]
    mask[rows] = True
    # numpy turns a list of up to a vocabulary of ids into indices without a Python loop over
    # them: this runs every step of such a request.
    flat = np.concatenate(
        [np.asarray(params[i].allowed_token_ids, dtype=np.int64) + i * vocab_size for i in rows]
    )  # [N]: row * V + token
    mask.view(-1)[torch.from_numpy(flat).to(device)] = False
    return mask


def _bad_word_bans(
    params: Sequence[SamplingParams],
    output_token_ids: Sequence[Sequence[int]],
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    rows: list[int] = []
    ids: list[int] = []
    for i, p in enumerate(params):
        if p.bad_words_token_ids:
            banned = bad_word_bans(p.bad_words_token_ids, output_token_ids[i])
            rows += [i] * len(banned)
            ids += banned
    if not rows:
        return None
    # One host->device copy for both index lists.
    both = torch.tensor([rows, ids], dtype=torch.int64, device=device)  # [2, N]
    return both[0], both[1]


def _bias(
    params: Sequence[SamplingParams], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    rows: list[int] = []
    ids: list[int] = []
    values: list[float] = []
    for i, p in enumerate(params):
        if p.logit_bias:
            rows += [i] * len(p.logit_bias)
            ids += p.logit_bias.keys()
            # Clamped as at OpenAI and vLLM (the HTTP API clamps already; the offline API
            # relies on this).
            values += [
                max(-MAX_ABS_LOGIT_BIAS, min(MAX_ABS_LOGIT_BIAS, v)) for v in p.logit_bias.values()
            ]
    if not rows:
        return None
    index = torch.tensor([rows, ids], dtype=torch.int64, device=device)  # [2, M]
    return index[0], index[1], torch.tensor(values, dtype=torch.float32, device=device)
