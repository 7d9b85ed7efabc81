"""Persistent per-request state of the model runner and the step's flattened inputs.

Each live request owns a row of preallocated numpy arrays (tokens, block table), so preparing a
step is a handful of vectorised gathers rather than a Python loop over every token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from corefleet.engine.protocol import SamplingParams


@dataclass
class RequestState:
    """What the runner remembers about one request between steps."""

    req_id: str
    row: int
    num_prompt_tokens: int
    sampling_params: SamplingParams
    generator: torch.Generator | None


@dataclass
class StepInputs:
    """The flattened batch of one step, in the order decode-like rows first."""

    req_ids: list[str]  # scheduled requests, batch order
    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    query_lens: np.ndarray  # [B] int64
    context_lens: np.ndarray  # [B] int64: tokens in the cache after this step
    rows: np.ndarray  # [B] int64: batch row of each request
    num_decodes: int  # leading requests with exactly one new token
    sample_mask: np.ndarray  # [B] bool: the request reaches its last token and samples


class InputBatch:
    """Rows of token ids and block tables for up to ``max_num_reqs`` live requests."""

    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int) -> None:
        self.block_size = block_size
        max_blocks = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks), dtype=np.int64)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.requests: dict[str, RequestState] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))

    def add(
        self,
        req_id: str,
        token_ids: list[int],
        num_prompt_tokens: int,
        block_ids: list[int],
        sampling_params: SamplingParams,
        generator: torch.Generator | None,
    ) -> None:
        if req_id in self.requests:
            self.remove(req_id)
        row = self._free_rows.pop()
        self.token_ids[row, : len(token_ids)] = token_ids
        self.num_tokens[row] = len(token_ids)
        self.num_blocks[row] = 0
        self.append_blocks(row, block_ids)
        self.requests[req_id] = RequestState(
            req_id, row, num_prompt_tokens, sampling_params, generator
        )

    def remove(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        if state is not None:
            self._free_rows.append(state.row)

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        if block_ids:
            start = int(self.num_blocks[row])
            self.block_table[row, start : start + len(block_ids)] = block_ids
            self.num_blocks[row] = start + len(block_ids)

    def append_token(self, row: int, token_id: int) -> None:
        self.token_ids[row, self.num_tokens[row]] = token_id
        self.num_tokens[row] += 1

    def output_token_ids(self, state: RequestState) -> list[int]:
        row = state.row
        return self.token_ids[row, state.num_prompt_tokens : self.num_tokens[row]].tolist()

    def prompt_token_ids(self, state: RequestState) -> list[int]:
        return self.token_ids[state.row, : state.num_prompt_tokens].tolist()

    def prepare(
        self, num_scheduled: dict[str, int], num_computed: dict[str, int]
    ) -> StepInputs:
        """Flatten the scheduled requests: positions, token ids and cache slots of every token."""
        decodes = [r for r, n in num_scheduled.items() if n == 1]
        others = [r for r, n in num_scheduled.items() if n != 1]
        req_ids = decodes + others
        rows = np.fromiter((self.requests[r].row for r in req_ids), np.int64, len(req_ids))
        query_lens = np.fromiter((num_scheduled[r] for r in req_ids), np.int64, len(req_ids))
        starts = np.fromiter((num_computed[r] for r in req_ids), np.int64, len(req_ids))
        context_lens = starts + query_lens

        # positions: for each request, starts[i] .. starts[i] + query_lens[i] - 1
        total = int(query_lens.sum())
        row_of_token = np.repeat(rows, query_lens)  # [T]
        first_token = np.cumsum(query_lens) - query_lens  # [B]
        offsets = np.arange(total, dtype=np.int64) - np.repeat(first_token, query_lens)
        positions = np.repeat(starts, query_lens) + offsets  # [T]

        input_ids = self.token_ids[row_of_token, positions]  # [T]
        blocks = self.block_table[row_of_token, positions // self.block_size]  # [T]
        slot_mapping = blocks * self.block_size + positions % self.block_size
        sample_mask = context_lens >= self.num_tokens[rows]
        return StepInputs(
            req_ids=req_ids,
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slot_mapping,
            query_lens=query_lens,
            context_lens=context_lens,
            rows=rows,
            num_decodes=len(decodes),
            sample_mask=sample_mask,
        )

    def context_slots(
        self, rows: np.ndarray, context_lens: np.ndarray, max_len: int
    ) -> np.ndarray:
        """Flat cache slots of positions [0, max_len) for each row: [len(rows), max_len].

        Positions at or past a row's context length map to slot 0 (the zeroed null block), so
        padding never reads uninitialised cache memory.
        """
        positions = np.arange(max_len, dtype=np.int64)
        blocks = self.block_table[rows[:, None], positions[None, :] // self.block_size]
        slots = blocks * self.block_size + positions[None, :] % self.block_size
        slots[positions[None, :] >= context_lens[:, None]] = 0
        return slots
