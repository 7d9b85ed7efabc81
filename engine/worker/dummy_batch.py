"""The dummy batch of an idle rank in an MoE group: one forward pass that changes nothing.

While any rank of an MoE group has work, every rank must run a forward pass each step, because
the expert-parallel layers exchange tokens inside it (``engine_core/waves.py``). A rank with
nothing to run runs this one: a single token (id 0, position 0) whose K/V go to slot 0 of
block 0, the reserved null block that no request owns (``core/block_pool.py``) and whose
contents no request reads (attention masks every position past a request's own context;
``kernels/reference.py``). Nothing is sampled and the batch state is untouched, so the rank's
requests and caches are exactly as before.
"""

from __future__ import annotations

import numpy as np
import torch

from corefleet.engine.worker.model_runner import ModelRunner
from corefleet.kernels.metadata import AttentionMetadata


@torch.inference_mode()
def execute_dummy_batch(runner: ModelRunner) -> None:
    """Run ``runner``'s model once over the dummy token, collectives included."""
    device = runner.device
    ids = torch.zeros(1, dtype=torch.long, device=device)  # [1]
    positions = torch.zeros(1, dtype=torch.long, device=device)  # [1]
    runner._forward(ids, positions, _metadata(runner))  # the real step's pass, no sampling


def _metadata(runner: ModelRunner) -> AttentionMetadata:
    """One decode-like request of one token whose only block is block 0, in the form the
    runner's backend reads (block tables, or the torch/C++ path's rows)."""
    device = runner.device
    slot = torch.zeros(1, dtype=torch.long, device=device)  # [1]: block 0, offset 0
    if runner.backend.needs_block_tables:
        return AttentionMetadata(
            num_tokens=1,
            slot_mapping=slot,
            num_decodes=1,
            decode_block_table=None,
            decode_mask=None,
            decode_context_lens=None,
            prefills=[],
            block_tables=runner._to_device(np.zeros((1, 1), dtype=np.int32)),  # [1, 1]
            seq_lens=runner._to_device(np.ones(1, dtype=np.int32)),  # [1]
            query_start_loc=runner._to_device(np.array([0, 1], dtype=np.int32)),  # [2]
            max_query_len=1,
            max_seq_len=1,
        )
    blocks = torch.zeros((1, 1), dtype=torch.long, device=device)  # [1, 1]
    lens = torch.ones(1, dtype=torch.long, device=device)  # [1]
    return AttentionMetadata(
        num_tokens=1,
        slot_mapping=slot,
        num_decodes=1,
        decode_block_table=blocks,
        decode_mask=None,
        decode_context_lens=lens,
        prefills=[],
        token_block_table=blocks,
        token_context_lens=lens,
    )
