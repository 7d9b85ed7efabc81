"""The pooling runner's output (``--runner pooling``): each request's prompt hidden states,
pooled into one vector when its prompt is fully computed, in place of a sampled token.

The hidden states are the final norm's (what ``lm_head`` would read, as Hugging Face's
``AutoModel`` returns them). LAST takes the prompt's last position, which the step that
completes the prompt always computes. MEAN and CLS need positions computed in earlier chunks
of a chunked prefill: a running float32 sum (MEAN) or the first position's state (CLS) is
kept per request between steps. Those requests never read the prefix cache (the scheduler
skips it for them: cached positions produce no hidden states), and a preempted request starts
again from position 0, so its state is dropped with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from corefleet.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from corefleet.engine.messages import PoolingParams
from corefleet.engine.worker.input_batch import StepInputs


@dataclass
class _Pooling:
    """One request's pooling and what it kept from earlier chunks."""

    params: PoolingParams
    kept: torch.Tensor | None = None  # [H] float32: MEAN's running sum, CLS's first state


def pool_vector(
    hidden: torch.Tensor,  # [N, H]: the request's positions computed this step
    kept: torch.Tensor | None,  # [H] float32 from earlier chunks (MEAN sum, CLS state)
    first_position: int,  # the position of hidden's row 0
    num_positions: int,  # the prompt's length
    params: PoolingParams,
) -> torch.Tensor:  # [D] float32
    """The pooled, truncated and (with ``use_activation``) L2-normalised vector; vLLM's head
    order: pool, truncate to ``dimensions``, then normalise."""
    kind = params.pooling_type
    if kind == "LAST":
        vector = hidden[-1].float()
    elif kind == "MEAN":
        total = hidden.float().sum(dim=0)
        vector = (total if kept is None else kept + total) / num_positions
    elif first_position == 0:  # CLS: the first position
        vector = hidden[0].float()
    else:  # CLS, its first position computed in an earlier chunk
        assert kept is not None, "CLS pooling needs position 0's hidden state"
        vector = kept
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    if params.use_activation:
        vector = F.normalize(vector, p=2, dim=-1)
    return vector


class Pooler:
    """The pooling requests of one model runner; see the module's docstring."""

    def __init__(self) -> None:
        self.requests: dict[str, _Pooling] = {}

    def update(self, so: SchedulerOutput) -> None:
        """Forget finished and preempted requests; take the new ones (a resumed one anew)."""
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            params = new.pooling_params
            if params is None:
                raise ValueError(f"request {new.req_id!r} has no pooling_params (--runner pooling)")
            if params.pooling_type != "LAST" and new.num_computed_tokens:
                # The scheduler skips the prefix cache for these: nothing can be computed yet.
                raise AssertionError(f"{params.pooling_type} pooling from a cached prefix")
            self.requests[new.req_id] = _Pooling(params)

    def output(self, inputs: StepInputs, hidden: torch.Tensor) -> ModelRunnerOutput:
        """Pool the requests whose prompt this step completes (``hidden``: [T, H]); keep the
        chunk state of the others. Nothing is sampled: the vectors are the step's output."""
        ends = np.cumsum(inputs.query_lens)  # [B] row after each request's last token
        starts = ends - inputs.query_lens  # [B]
        first_positions = inputs.context_lens - inputs.query_lens  # [B]
        pooled: dict[str, bytes] = {}
        for i, req_id in enumerate(inputs.req_ids):
            state = self.requests[req_id]
            rows = hidden[int(starts[i]) : int(ends[i])]  # [n, H]
            first = int(first_positions[i])
            if inputs.sample_mask[i]:
                vector = pool_vector(
                    rows, state.kept, first, int(inputs.context_lens[i]), state.params
                )
                pooled[req_id] = vector.cpu().numpy().astype("<f4").tobytes()
            elif state.params.pooling_type == "MEAN":
                total = rows.float().sum(dim=0)
                state.kept = total if state.kept is None else state.kept + total
            elif state.params.pooling_type == "CLS" and first == 0:
                state.kept = rows[0].float().clone()
        return ModelRunnerOutput(
            req_ids=inputs.req_ids,
            sampled_token_ids=[[] for _ in inputs.req_ids],
            pooler_output=pooled,
        )
