"""Persistent per-request state of the model runner and the step's flattened inputs.

Each live request owns a row of preallocated numpy arrays (tokens, block table), so preparing a
step is a handful of vectorised gathers rather than a Python loop over every token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from corefleet.engine.messages import SamplingParams


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
        self.num_computed = np.zeros(max_num_reqs, dtype=np.int64)  # tokens in the KV cache
        self.block_table = np.zeros((max_num_reqs, max_blocks), dtype=np.int64)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        # Flat cache slot of every position of every row, kept in step with the block table so
        # that a step's slot lookups are plain gathers (0, the null block, where unallocated).
        self.slot_table = np.zeros((max_num_reqs, max_blocks * block_size), dtype=np.int64)
        self._block_offsets = np.arange(block_size, dtype=np.int64)
        self.requests: dict[str, RequestState] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))
        # The last decode-only step's request order and rows: consecutive decode steps of an
        # unchanged batch reuse the rows instead of looking up every request again.
        self._decode_ids: list[str] | None = None
        self._decode_rows = np.zeros(0, dtype=np.int64)

    def add(
        self,
        req_id: str,
        token_ids: list[int],
        num_prompt_tokens: int,
        block_ids: list[int],
        num_computed_tokens: int,
        sampling_params: SamplingParams,
        generator: torch.Generator | None,
    ) -> None:
        if req_id in self.requests:
            self.remove(req_id)
        self._decode_ids = None
        row = self._free_rows.pop()
        self.token_ids[row, : len(token_ids)] = token_ids
        self.num_tokens[row] = len(token_ids)
        self.num_computed[row] = num_computed_tokens
        self.num_blocks[row] = 0
        self.block_table[row] = 0  # rows are reused: no stale block ids past the new ones
        self.append_blocks(row, block_ids)
        self.requests[req_id] = RequestState(
            req_id, row, num_prompt_tokens, sampling_params, generator
        )

    def remove(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        self._decode_ids = None
        if state is not None:
            self._free_rows.append(state.row)

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        if block_ids:
            start, bs = int(self.num_blocks[row]), self.block_size
            ids = np.asarray(block_ids, dtype=np.int64)
            self.block_table[row, start : start + len(ids)] = ids
            self.slot_table[row, start * bs : (start + len(ids)) * bs] = (
                ids[:, None] * bs + self._block_offsets
            ).ravel()
            self.num_blocks[row] = start + len(ids)

    def append_blocks_to_rows(self, rows: list[int], block_ids: list[list[int]]) -> None:
        """``append_blocks`` for many rows; one vectorised write when each gets one block (the
        decode case: a request crosses into a new block every ``block_size`` tokens)."""
        if any(len(ids) != 1 for ids in block_ids):
            for row, ids in zip(rows, block_ids, strict=True):
                self.append_blocks(row, ids)
            return
        row_arr = np.asarray(rows, dtype=np.int64)  # [R]
        new_ids = np.asarray(block_ids, dtype=np.int64)[:, 0]  # [R]
        starts = self.num_blocks[row_arr]  # [R]
        self.block_table[row_arr, starts] = new_ids
        bs = self.block_size
        columns = starts[:, None] * bs + self._block_offsets  # [R, bs]
        self.slot_table[row_arr[:, None], columns] = new_ids[:, None] * bs + self._block_offsets
        self.num_blocks[row_arr] = starts + 1

    def append_tokens(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """Append one sampled token to each of ``rows`` (distinct rows)."""
        self.token_ids[rows, self.num_tokens[rows]] = token_ids
        self.num_tokens[rows] += 1

    def write_tokens(self, row: int, start: int, token_ids: list[int]) -> None:
        """Set ``row``'s tokens from position ``start`` (the scheduler's, under pipeline
        parallelism: tokens already known are written again, the same)."""
        end = start + len(token_ids)
        self.token_ids[row, start:end] = token_ids
        self.num_tokens[row] = max(int(self.num_tokens[row]), end)

    def output_token_ids(self, state: RequestState) -> list[int]:
        row = state.row
        return self.token_ids[row, state.num_prompt_tokens : self.num_tokens[row]].tolist()

    def prompt_token_ids(self, state: RequestState) -> list[int]:
        return self.token_ids[state.row, : state.num_prompt_tokens].tolist()

    def prepare(self, num_scheduled: dict[str, int]) -> StepInputs:
        """Flatten the scheduled requests: positions, token ids and cache slots of every token,
        then advance each request's computed-token count by what it computes now."""
        req_ids = list(num_scheduled)
        if sum(num_scheduled.values()) == len(req_ids):  # decode only: one token each
            decodes, others = req_ids, []
            if req_ids == self._decode_ids:  # the same batch as the last decode step
                rows = self._decode_rows
            else:
                rows = self._rows_of(req_ids)
                self._decode_ids, self._decode_rows = req_ids, rows
        else:
            decodes = [r for r, n in num_scheduled.items() if n == 1]
            others = [r for r, n in num_scheduled.items() if n != 1]
            req_ids = decodes + others
            rows = self._rows_of(req_ids)
        query_lens = np.ones(len(req_ids), dtype=np.int64)
        query_lens[len(decodes) :] = [num_scheduled[r] for r in others]
        starts = self.num_computed[rows]  # [B]
        context_lens = starts + query_lens  # [B]
        self.num_computed[rows] = context_lens

        if not others:  # the common decode-only step: one token per request
            positions = starts
            row_of_token = rows
        else:  # positions of request i: starts[i] .. starts[i] + query_lens[i] - 1
            total = int(query_lens.sum())
            row_of_token = np.repeat(rows, query_lens)  # [T]
            first_token = np.cumsum(query_lens) - query_lens  # [B]
            offsets = np.arange(total, dtype=np.int64) - np.repeat(first_token, query_lens)
            positions = np.repeat(starts, query_lens) + offsets  # [T]

        return StepInputs(
            req_ids=req_ids,
            input_ids=self.token_ids[row_of_token, positions],  # [T]
            positions=positions,
            slot_mapping=self.slot_table[row_of_token, positions],  # [T]
            query_lens=query_lens,
            context_lens=context_lens,
            rows=rows,
            num_decodes=len(decodes),
            sample_mask=context_lens >= self.num_tokens[rows],
        )

    def _rows_of(self, req_ids: list[str]) -> np.ndarray:  # [B] int64
        requests = self.requests
        return np.fromiter((requests[r].row for r in req_ids), np.int64, len(req_ids))

    def context_slots(
        self, rows: np.ndarray, context_lens: np.ndarray, max_len: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Flat cache slots of positions [0, max_len) of each row, and which are inside the
        row's context: two ``[len(rows), max_len]`` arrays (int64, bool).

        Positions at or past a row's context length map to slot 0 (the zeroed null block), so
        padding never reads uninitialised cache memory.
        """
        inside = np.arange(max_len)[None, :] < context_lens[:, None]  # [B, L]
        return np.where(inside, self.slot_table[rows, :max_len], 0), inside

    def decode_blocks(self, rows: np.ndarray, context_lens: np.ndarray) -> np.ndarray:
        """Block tables of ``rows`` cut to the longest context: ``[B, nb]`` int64.

        Block ids past a row's last block are 0, the zeroed null block.
        """
        num_blocks = -(-int(context_lens.max()) // self.block_size)
        return self.block_table[rows, :num_blocks]
