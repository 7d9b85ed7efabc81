"""Prefix-cache identity of KV blocks: chained SHA-256 hashes over full blocks of tokens.

A block's hash covers its own tokens *and* (through the parent hash) every token before it, so
two requests share a cached block only when their whole prefixes up to that block are equal.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec

from corefleet.engine.request import BlockHasher, Request

BlockHash = bytes

# Seed standing in for the parent of a request's first block. It is fixed rather than random
# per process (vLLM's default) so that every engine rank and the coordinator compute the same
# hashes for the same prompt, which prefix-aware routing relies on. SHA-256 keeps collisions out
# of reach either way.
NONE_HASH: BlockHash = hashlib.sha256(b"corefleet/block-hash/v1").digest()

# msgpack is deterministic for ints, bytes, strings and arrays, unlike pickle across versions.
_encode = msgspec.msgpack.Encoder().encode


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple[str, ...] | None = None,
) -> BlockHash:
    """Hash one full block: ``sha256(msgpack((parent or NONE_HASH, tokens, extra_keys)))``."""
    payload = _encode((parent_hash or NONE_HASH, token_ids, extra_keys))
    return hashlib.sha256(payload).digest()


def make_block_hasher(block_size: int) -> BlockHasher:
    """Return the callback that extends ``Request.block_hashes`` with newly full blocks.

    The callback hashes only full blocks not hashed yet, chaining from the last known hash, so
    calling it after every appended token costs one comparison until a block fills up. The
    request's ``cache_salt`` goes into the extra keys of the first block only; since every later
    hash chains from it, a salt separates the whole chain.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")

    def hasher(request: Request) -> list[BlockHash]:
        hashes = request.block_hashes
        start = len(hashes) * block_size
        tokens = request.all_token_ids
        if start + block_size > len(tokens):
            return []  # the hot path: no block completed by the last token
        parent = hashes[-1] if hashes else None
        new_hashes: list[BlockHash] = []
        while start + block_size <= len(tokens):
            extra = (request.cache_salt,) if start == 0 and request.cache_salt else None
            parent = hash_block_tokens(parent, tokens[start : start + block_size], extra)
            new_hashes.append(parent)
            start += block_size
        return new_hashes

    hasher.block_size = block_size  # type: ignore[attr-defined]  # lets Request skip calls
    return hasher
