"""The tokens a step may not sample, per request: what the model runner masks before sampling.

Two rules ban tokens: ``min_tokens`` (EOS and the stop tokens, until enough tokens came out)
and a structured-output grammar (every token it does not allow next, as computed by the engine
while the forward pass ran).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from corefleet.engine.core.scheduler_output import GrammarOutput
from corefleet.engine.worker.input_batch import RequestState


def ban_stop_tokens_below_min_tokens(
    logits: torch.Tensor,
    states: list[RequestState],
    num_tokens: np.ndarray,
    eos_token_ids: Sequence[int],
) -> None:
    """Until a request has ``min_tokens`` outputs, EOS and its stop tokens cannot be sampled
    (as in vLLM), so the request neither stops nor emits them early. ``logits`` is ``[N, V]``,
    row ``k`` for ``states[k]``; ``num_tokens`` the batch's token count per batch row."""
    rows: list[int] = []
    cols: list[int] = []
    for k, state in enumerate(states):
        params = state.sampling_params
        if not params.min_tokens:
            continue
        num_output = int(num_tokens[state.row]) - state.num_prompt_tokens
        if num_output >= params.min_tokens:
            continue
        banned = set(params.stop_token_ids)
        if not params.ignore_eos:
            banned.update(eos_token_ids)
        rows.extend([k] * len(banned))
        cols.extend(banned)
    if rows:
        logits[torch.tensor(rows), torch.tensor(cols)] = float("-inf")


def grammar_rows(
    grammar: GrammarOutput, states: list[RequestState], device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The sampled rows of the constrained requests (None: all rows, in order) and the tokens
    their grammars forbid ``[K, V]``, on ``device``."""
    row_of = {state.req_id: k for k, state in enumerate(states)}
    rows = [row_of[req_id] for req_id in grammar.req_ids]
    banned = torch.from_numpy(grammar.banned).to(device)  # [K, V] bool
    if rows == list(range(len(states))):
        return None, banned
    return torch.tensor(rows, dtype=torch.int64, device=device), banned
