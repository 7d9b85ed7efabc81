"""Prompt logprobs (vLLM's ``prompt_logprobs``): the logprob of every prompt token and its top-N,
computed from the logits of the prefill, chunk by chunk.

The logits at position ``p`` predict token ``p + 1``, so a chunk covering positions
``[start, end)`` scores prompt tokens ``start + 1 .. min(end, P - 1)`` (``P`` prompt tokens); the
last prompt position predicts the first output token and belongs to sampling. The first prompt
token has no logprob. Rows gather over a request's chunks here and leave, all at once, with
the step that completes its prompt (the one that samples its first token).

Every prompt position needs its logits, so such a request must compute its whole prompt: the
scheduler does not read the prefix cache for it (``Request.skip_reading_prefix_cache``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from corefleet.engine.messages import Logprobs
from corefleet.engine.worker.input_batch import InputBatch, StepInputs

# Positions scored per logits matrix: [ROWS, V] float32 is ~100 MB at a 50k vocabulary, where a
# whole 8k-token prefill at once would be 1.6 GB.
ROWS_PER_SLICE = 512


@dataclass
class _Pending:
    """The rows computed so far for one request."""

    num_top: int  # N: top candidates per position besides the prompt token
    token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)


class PromptLogprobsTracker:
    """Per-request prompt logprobs under way in one model runner."""

    def __init__(self) -> None:
        self._pending: dict[str, _Pending] = {}

    def start(self, req_id: str, num_top: int | None, num_output_tokens: int) -> None:
        """Score the prompt of a request the runner adds, as it is computed, if it asks for
        prompt logprobs (``num_top`` not None) and has none yet: a request resumed after
        preemption with output tokens has sent them already."""
        if num_top is not None and not num_output_tokens:
            self._pending[req_id] = _Pending(num_top)

    def drop(self, req_id: str) -> None:
        """Forget a finished or preempted request (a preempted one starts over if resumed
        before its prompt completed)."""
        self._pending.pop(req_id, None)

    def step(
        self,
        inputs: StepInputs,
        hidden: torch.Tensor,  # [T, H]: the step's hidden states, token order of ``inputs``
        batch: InputBatch,
        compute_logits: Callable[[torch.Tensor], torch.Tensor],  # [N, H] -> [N, V] float32
    ) -> dict[str, Logprobs]:
        """Score this step's prompt positions of the tracked requests; returns the complete
        prompt logprobs of those whose prompt this step finishes."""
        if not self._pending:
            return {}
        first_token = np.cumsum(inputs.query_lens) - inputs.query_lens  # [B]
        hidden_rows: list[np.ndarray] = []
        targets: list[np.ndarray] = []
        owners: list[tuple[str, int]] = []  # (request, its number of scored positions)
        finished: list[str] = []
        for i, req_id in enumerate(inputs.req_ids):
            pending = self._pending.get(req_id)
            if pending is None:
                continue
            state = batch.requests[req_id]
            end = int(inputs.context_lens[i])
            start = end - int(inputs.query_lens[i])
            last = min(end, state.num_prompt_tokens - 1)  # positions [start, last) are scored
            if last > start:
                hidden_rows.append(first_token[i] + np.arange(last - start))
                targets.append(batch.token_ids[state.row, start + 1 : last + 1])
                owners.append((req_id, last - start))
            if end >= state.num_prompt_tokens:
                finished.append(req_id)
        if owners:
            self._score(
                hidden, np.concatenate(hidden_rows), np.concatenate(targets), owners, compute_logits
            )
        return {req_id: self._complete(req_id) for req_id in finished}

    def _score(
        self,
        hidden: torch.Tensor,  # [T, H]
        rows: np.ndarray,  # [M] int64: hidden row of each scored position
        targets: np.ndarray,  # [M] int64: the prompt token each position predicts
        owners: list[tuple[str, int]],
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        num_top = max(self._pending[req_id].num_top for req_id, _ in owners)
        device = hidden.device
        ids_parts, values_parts, rank_parts = [], [], []
        for lo in range(0, len(rows), ROWS_PER_SLICE):
            index = torch.from_numpy(rows[lo : lo + ROWS_PER_SLICE]).to(device)
            target = torch.from_numpy(targets[lo : lo + ROWS_PER_SLICE]).to(device)  # [m]
            logprobs = torch.log_softmax(compute_logits(hidden[index]).float(), dim=-1)  # [m, V]
            chosen = logprobs.gather(1, target[:, None])  # [m, 1]
            # 1 + the candidates strictly more likely: ties share the better rank, as vLLM's.
            rank_parts.append((logprobs > chosen).sum(dim=1) + 1)  # [m]
            top_values, top_ids = logprobs.topk(num_top, dim=-1)  # [m, N]
            ids_parts.append(torch.cat([target[:, None], top_ids], dim=1))  # [m, 1 + N]
            values_parts.append(torch.cat([chosen, top_values], dim=1))  # [m, 1 + N]
        ids = torch.cat(ids_parts).tolist()
        values = torch.cat(values_parts).tolist()
        ranks = torch.cat(rank_parts).tolist()
        at = 0
        for req_id, count in owners:
            pending = self._pending[req_id]
            width = 1 + pending.num_top
            pending.token_ids += [row[:width] for row in ids[at : at + count]]
            pending.logprobs += [row[:width] for row in values[at : at + count]]
            pending.ranks += ranks[at : at + count]
            at += count

    def _complete(self, req_id: str) -> Logprobs:
        pending = self._pending.pop(req_id)
        return Logprobs(pending.token_ids, pending.logprobs, pending.ranks)
