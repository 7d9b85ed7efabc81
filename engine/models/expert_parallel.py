"""Expert parallelism: the experts of every MoE layer split over the ranks of a data-parallel
group (``--enable-expert-parallel``).

Each of the ``size`` ranks holds ``E / size`` consecutive experts and its own batch of tokens
(data-parallel attention). In a MoE layer every rank gathers all ranks' tokens, routes them
(the router is whole on every rank, so every rank computes the same routing), runs the tokens
that chose one of its experts, and the ranks' partial outputs are summed, each rank keeping its
own tokens' rows. This is the all-gather + reduce-scatter form of the dispatch: it moves every
token to every rank, where an all-to-all would move each token only to the ranks of its
experts, but it needs no per-token bookkeeping and gloo has no all-to-all of uneven parts; at
the sizes a CPU serves, the matmuls dominate. On NCCL the sum is a reduce-scatter; gloo has no
reduce-scatter, so there it is an all-reduce of which each rank keeps its rows.

Ranks hold different numbers of tokens (an idle rank runs a one-token dummy batch, see the
data-parallel waves), so the gather pads every rank's tokens to the largest count, and the
padding rows choose no expert.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class GatheredTokens:
    """Every rank's tokens, side by side: rank ``r``'s ``counts[r]`` rows start at row
    ``r * rows_per_rank``; the rest of its ``rows_per_rank`` rows are padding."""

    x: torch.Tensor  # [size * rows_per_rank, H]
    counts: list[int]
    rows_per_rank: int

    def valid(self) -> torch.Tensor:  # [size * rows_per_rank] bool: False on padding rows
        """Which rows are real tokens."""
        row = torch.arange(self.rows_per_rank, device=self.x.device)  # [M]
        counts = torch.tensor(self.counts, device=self.x.device)  # [size]
        return (row.unsqueeze(0) < counts.unsqueeze(1)).reshape(-1)


@dataclass(frozen=True)
class ExpertParallel:
    """This rank's place among the ``size`` ranks that share the experts (``group``: their
    ``torch.distributed`` group, None for the default group)."""

    rank: int = 0
    size: int = 1
    group: Any = None  # dist.ProcessGroup

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def experts(self, num_experts: int) -> range:
        """The (global) indices of the experts this rank holds.

        Raises:
            ValueError: ``num_experts`` does not split evenly over the ranks.
        """
        if num_experts % self.size:
            raise ValueError(
                f"invalid engine argument enable_expert_parallel: the model has {num_experts} "
                f"experts, which {self.size} data-parallel ranks cannot split evenly"
            )
        per_rank = num_experts // self.size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    def gather(self, x: torch.Tensor) -> GatheredTokens:  # x: [T, H], this rank's tokens
        """Every rank's tokens (two collectives: the counts, then the padded rows)."""
        count = torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device)
        counts = [torch.empty_like(count) for _ in range(self.size)]
        dist.all_gather(counts, count, group=self.group)
        sizes = [int(c.item()) for c in counts]
        rows = max(max(sizes), 1)
        padded = x.new_zeros(rows, x.shape[1])  # [M, H]
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(parts, padded, group=self.group)
        return GatheredTokens(torch.cat(parts), sizes, rows)

    def combine(self, partial: torch.Tensor, gathered: GatheredTokens) -> torch.Tensor:
        """The sum over ranks of ``partial`` ``[size * M, H]`` (each rank's experts' share of
        every token), this rank's rows only: ``[counts[rank], H]``."""
        rows = gathered.rows_per_rank
        if dist.get_backend(self.group) == "nccl":
            mine = partial.new_empty(rows, partial.shape[1])  # [M, H]
            dist.reduce_scatter_tensor(mine, partial.contiguous(), group=self.group)
        else:  # gloo has no reduce-scatter
            dist.all_reduce(partial, group=self.group)
            mine = partial[self.rank * rows : (self.rank + 1) * rows]
        return mine[: gathered.counts[self.rank]]
