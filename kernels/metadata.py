"""Per-step attention inputs, built once by the model runner and shared by every layer.

Batch layout: the flattened token batch holds the *decode-like* requests first (one new token
each), then the requests that compute several tokens this step (prefill chunks).

Two sets of fields, filled for the backend in use (``KernelBackend.needs_block_tables``):
the torch path takes precomputed gathers (decode rows attended to in one padded, vectorised
call; multi-token rows one request at a time), and the C++ CPU kernel the same step as token
rows (every new token with its request's block table and its own length, all in one call);
the Triton and flash-attn kernels walk each request's block table themselves and take the
block tables, lengths and query offsets of every request instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PrefillSpan:
    """One request computing several tokens this step."""

    token_start: int  # first row of this request in the flattened batch
    num_new_tokens: int  # rows it owns: [token_start, token_start + num_new_tokens)
    context_len: int  # tokens in its KV cache after this step (cached + new)
    context_slots: torch.Tensor | None  # [context_len] int64 cache slots; None if no cached prefix


@dataclass
class AttentionMetadata:
    """Where the new tokens' K/V go and what each query attends to."""

    num_tokens: int
    slot_mapping: torch.Tensor  # [num_tokens] int64: flat cache slot of each new token
    num_decodes: int  # rows [0, num_decodes) are single-token requests
    # Decode rows gather whole blocks: block ids past a row's last block are 0 (the zeroed null
    # block), and the mask hides every position at or past the row's context length.
    decode_block_table: torch.Tensor | None  # [num_decodes, max_blocks] int64
    # Optional: the torch reference derives it from decode_context_lens when None (the model
    # runner leaves it None; the CPU kernel walks the lengths and never needs it).
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size] bool
    decode_context_lens: torch.Tensor | None  # [num_decodes] int64, cached + the new token
    prefills: list[PrefillSpan]
    # Every new token as a decode-style row, for the C++ CPU kernel, which attends a whole
    # step (decode rows and prefill chunks) in one call: token t's request's blocks and its
    # context length (its position + 1), so causality is the row's length. Filled with the
    # fields above; for a decode-only step they are decode_block_table / decode_context_lens.
    token_block_table: torch.Tensor | None = None  # [num_tokens, max_blocks] int64
    token_context_lens: torch.Tensor | None = None  # [num_tokens] int64
    # For backends that take block tables directly (Triton, flash-attn); the torch path uses
    # the precomputed slots above. Requests in batch order; block ids past a request's last
    # block are 0 and never read.
    block_tables: torch.Tensor | None = None  # [num_reqs, max_blocks] int32
    seq_lens: torch.Tensor | None = None  # [num_reqs] int32, context length after this step
    query_start_loc: torch.Tensor | None = None  # [num_reqs + 1] int32: rows of request r
    max_query_len: int = 0  # longest query_start_loc[r + 1] - query_start_loc[r] (grid size)
    max_seq_len: int = 0  # longest seq_lens[r] (flash-attn's max_seqlen_k)
