"""Builders shared by the sampler tests: a batch's SamplingMetadata and seeded generators."""

from __future__ import annotations

import torch

from corefleet.engine.messages import SamplingParams
from corefleet.engine.worker.sampling_metadata import SamplingMetadata

CPU = torch.device("cpu")


def build(
    params: list[SamplingParams],
    vocab_size: int,
    generators: list[torch.Generator | None] | None = None,
    outputs: list[list[int]] | None = None,
    prompts: list[list[int]] | None = None,
) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(
        params,
        generators if generators is not None else [None] * n,
        outputs if outputs is not None else [[] for _ in range(n)],
        prompts if prompts is not None else [[] for _ in range(n)],
        vocab_size,
        CPU,
    )


def seeded_gen(seed: int) -> torch.Generator:
    return torch.Generator(device=CPU).manual_seed(seed)
