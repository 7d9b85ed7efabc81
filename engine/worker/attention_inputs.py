"""A step's attention metadata: what the kernels need to find each token's context in the
paged KV cache, built from the batch's rows (block tables, context lengths, prefill spans)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from corefleet.engine.worker.input_batch import InputBatch, StepInputs
from corefleet.kernels.metadata import AttentionMetadata, PrefillSpan


class AttentionInputs:
    """Builds :class:`AttentionMetadata` for the torch path (gathered slots per decode and per
    prefill) or, for kernels that walk block tables themselves, the tables alone."""

    def __init__(
        self,
        batch: InputBatch,
        block_tables: bool,
        block_size: int,
        to_device: Callable[[np.ndarray], torch.Tensor],
    ) -> None:
        self.batch = batch
        self.block_tables = block_tables  # the backend's needs_block_tables
        self.block_size = block_size
        self._to_device = to_device

    def metadata(self, inputs: StepInputs) -> AttentionMetadata:
        """The attention metadata of a step whose batch rows are ``inputs``."""
        if self.block_tables:
            return self._block_table_metadata(inputs)
        nd = inputs.num_decodes
        decode_blocks = decode_lens = None
        if nd:
            blocks = self.batch.decode_blocks(inputs.rows[:nd], inputs.context_lens[:nd])
            decode_blocks = self._to_device(blocks)  # [Bd, nb]
            decode_lens = self._to_device(inputs.context_lens[:nd])  # [Bd]
        prefills = []
        token_start = nd
        for i in range(nd, len(inputs.req_ids)):
            n, ctx = int(inputs.query_lens[i]), int(inputs.context_lens[i])
            slots_i: torch.Tensor | None = None
            if ctx > n:  # part of the context is already cached: attend through the cache
                context_slots, _ = self.batch.context_slots(
                    inputs.rows[i : i + 1], inputs.context_lens[i : i + 1], ctx
                )
                slots_i = self._to_device(context_slots[0])
            prefills.append(PrefillSpan(token_start, n, ctx, slots_i))
            token_start += n
        token_blocks, token_lens = decode_blocks, decode_lens
        if prefills:
            token_blocks, token_lens = self._token_rows(inputs)
        return AttentionMetadata(
            num_tokens=len(inputs.input_ids),
            slot_mapping=self._to_device(inputs.slot_mapping),
            num_decodes=nd,
            decode_block_table=decode_blocks,
            decode_mask=None,  # derived from decode_lens by the backend that needs one
            decode_context_lens=decode_lens,
            prefills=prefills,
            token_block_table=token_blocks,
            token_context_lens=token_lens,
        )

    def _token_rows(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Every new token's request blocks and context length (its position + 1)."""
        query_lens = inputs.query_lens  # [B]
        first_token = np.cumsum(query_lens) - query_lens  # [B] each request's first row
        rows = np.repeat(inputs.rows, query_lens)  # [T] batch row of each token
        offset = np.arange(len(rows)) - np.repeat(first_token, query_lens)  # [T] in its request
        lens = np.repeat(inputs.context_lens - query_lens, query_lens) + offset + 1  # [T]
        blocks = self.batch.decode_blocks(rows, lens)  # [T, nb]
        return self._to_device(blocks), self._to_device(lens)

    def _block_table_metadata(self, inputs: StepInputs) -> AttentionMetadata:
        """For kernels that walk block tables themselves (Triton, flash-attn): each request's
        blocks, context length and query rows, and none of the torch path's gathers."""
        max_seq_len = int(inputs.context_lens.max())
        num_blocks = -(-max_seq_len // self.block_size)
        tables = self.batch.block_table[inputs.rows, :num_blocks].astype(np.int32)  # [B, nb]
        query_start_loc = np.zeros(len(inputs.rows) + 1, dtype=np.int32)  # [B + 1]
        np.cumsum(inputs.query_lens, out=query_start_loc[1:])
        return AttentionMetadata(
            num_tokens=len(inputs.input_ids),
            slot_mapping=self._to_device(inputs.slot_mapping),
            num_decodes=inputs.num_decodes,
            decode_block_table=None,
            decode_mask=None,
            decode_context_lens=None,
            prefills=[],
            block_tables=self._to_device(tables),
            seq_lens=self._to_device(inputs.context_lens.astype(np.int32)),
            query_start_loc=self._to_device(query_start_loc),
            max_query_len=int(inputs.query_lens.max()),
            max_seq_len=max_seq_len,
        )
