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

    An engine has one: the scheduler builds it (``Scheduler.block_hasher``, None without prefix
    caching) and the engine builds every ``Request`` with that one.
    """
    return ChainedBlockHasher(block_size)


class ChainedBlockHasher:
    """Hashes a request's full blocks not hashed yet, chaining from the last known hash.

    ``Request`` calls it only when its token count reaches the next full block (from
    ``block_size``). The request's ``cache_salt`` goes into the extra keys of the first block
    only; since every later hash chains from it, a salt separates the whole chain.
    """

    __slots__ = ("block_size",)

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size

    def __call__(self, request: Request) -> list[BlockHash]:
        block_size = self.block_size
        hashes = request.block_hashes
        tokens = request.all_token_ids
        first = len(hashes) * block_size
        if first + block_size > len(tokens):
            return []  # no block completed since the last call
        parent = hashes[-1] if hashes else None
        return hash_full_blocks(tokens, block_size, request.cache_salt, first, parent)


def hash_full_blocks(
    tokens: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    first: int = 0,
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Chained hashes of the full blocks of ``tokens`` from token ``first`` on.

    ``parent`` is the hash of the block before ``first`` (None at the start). The scheduler's
    hasher and the coordinator's prefix-aware router both call this, so a prefix the router
    considers shared is one the engine's prefix cache can reuse.
    """
    hashes: list[BlockHash] = []
    for start in range(first, len(tokens) - block_size + 1, block_size):
        extra = (cache_salt,) if start == 0 and cache_salt else None
        parent = hash_block_tokens(parent, tokens[start : start + block_size], extra)
        hashes.append(parent)
    return hashes
