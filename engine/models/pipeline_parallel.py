"""Pipeline parallelism: which layers a stage holds, and how activations move between stages.

``P`` stages split the decoder's layers in order (stage ``s`` holds layers ``s*L//P`` up to
``(s+1)*L//P``); the first also holds the embedding, the last the final norm and the LM head
(and, for a tied head, the embedding table as its weight). A stage's output, the hidden states
and the residual of every token of the step, goes to the next stage's worker of the same
tensor-parallel rank (``torch.distributed`` send/recv, in call order: each pair of workers
sees the steps in the same order). Each stage works on its own step: with ``P`` steps in
flight (the engine's batch queue) every stage is busy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class PipelineStage:
    """Stage ``stage`` of ``num_stages``, for a worker whose global rank is ``global_rank`` in
    groups of ``tp_size`` tensor-parallel workers per stage."""

    stage: int = 0
    num_stages: int = 1
    global_rank: int = 0
    tp_size: int = 1

    @property
    def enabled(self) -> bool:
        return self.num_stages > 1

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def layers(self, num_layers: int) -> range:
        """The decoder layers this stage holds."""
        n = self.num_stages
        return range(self.stage * num_layers // n, (self.stage + 1) * num_layers // n)

    def send(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:  # [T, H] each
        """This stage's output to the next stage's worker of the same tensor-parallel rank."""
        dist.send(hidden.contiguous(), dst=self.global_rank + self.tp_size)
        dist.send(residual.contiguous(), dst=self.global_rank + self.tp_size)

    def recv(
        self, num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [T, H] each
        """The previous stage's output for a step of ``num_tokens`` tokens."""
        hidden = torch.empty(num_tokens, hidden_size, dtype=dtype, device=device)
        residual = torch.empty_like(hidden)
        dist.recv(hidden, src=self.global_rank - self.tp_size)
        dist.recv(residual, src=self.global_rank - self.tp_size)
        return hidden, residual


def check_pipeline_parallel(num_layers: int, num_stages: int) -> None:
    """Raise ``ValueError`` when a stage would hold no layer."""
    if num_stages > num_layers:
        raise ValueError(
            f"invalid engine argument pipeline_parallel_size={num_stages}: the model has "
            f"{num_layers} layers, fewer than the stages"
        )
