"""Per-request KV-cache bookkeeping on top of the block pool, with prefix caching.

Each request owns an append-only list of blocks (its block table): slot ``i`` of the request
lives in block ``i // block_size``. Blocks whose tokens are all committed are entered into the
prefix cache under the request's chained block hashes, so later requests with the same prefix
reuse them instead of recomputing.
"""

from __future__ import annotations

from corefleet.engine.core.block_hash import BlockHash
from corefleet.engine.core.block_pool import BlockPool, KVCacheBlock
from corefleet.engine.request import Request

__all__ = [
    "BlockHash",
    "BlockPool",
    "KVCacheBlock",
    "KVCacheManager",
    "num_blocks_for_memory",
]


def num_blocks_for_memory(
    budget_bytes: int,
    block_size: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype_bytes: int,
) -> int:
    """How many blocks (null block included) fit in ``budget_bytes`` of K and V tensors."""
    bytes_per_block = 2 * block_size * num_layers * num_kv_heads * head_dim * dtype_bytes
    if bytes_per_block <= 0:
        raise ValueError("block geometry must be positive")
    return max(budget_bytes, 0) // bytes_per_block


class KVCacheManager:
    """Allocates blocks to requests and serves prefix-cache hits.

    Counters ``prefix_cache_queries`` / ``prefix_cache_hits`` count tokens looked up and tokens
    found, once per admission (not per attempt), cumulatively.
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool, max_model_len: int
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are already in the prefix cache.
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests."""
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of ``request``: ``(blocks, num_tokens)``.

        At most ``num_tokens - 1`` tokens can hit, so the last token is always computed and
        yields logits to sample from (on a full-prompt hit that recomputes a whole block, since
        hits are block-aligned). Chained hashes make any block after a miss a miss too, so the
        walk stops there. The blocks are *not* touched: that happens in :meth:`allocate_slots`,
        once the allocation is certain to succeed.
        """
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        get_cached = self.block_pool.get_cached_block
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = get_cached(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens of ``request``; return the new blocks.

        ``new_computed_blocks`` / ``num_new_computed_tokens`` are a prefix hit from
        :meth:`get_computed_blocks` (first allocation of a request only). Token layout:
        ``| already computed | prefix hit | new tokens |``.

        Returns ``None`` without touching any state when the free blocks do not suffice.
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be positive, got {num_new_tokens}")
        req_id = request.request_id
        req_blocks = self.req_to_blocks.get(req_id)
        if req_blocks is not None and not new_computed_blocks:
            # Hot path, taken by every running request every step: keep it lean.
            num_total = request.num_computed_tokens + num_new_tokens
            block_size = self.block_size
            num_slots = num_total if num_total < self.max_model_len else self.max_model_len
            num_required = (num_slots + block_size - 1) // block_size - len(req_blocks)
            new_blocks: list[KVCacheBlock] = []
            if num_required > 0:
                if num_required > self.block_pool.free_block_queue.num_free_blocks:
                    return None
                new_blocks = self.block_pool.get_new_blocks(num_required)
                req_blocks.extend(new_blocks)
            if self.enable_caching and num_total // block_size > self.num_cached_block[req_id]:
                self._cache_blocks(request, min(num_total, len(request.all_token_ids)))
            return new_blocks

        is_new = req_blocks is None
        num_held = len(req_blocks) if req_blocks is not None else 0
        num_revived = 0
        if new_computed_blocks:
            num_held += len(new_computed_blocks)
            # Hit blocks still in the free queue leave it when touched: they cost free blocks.
            num_revived = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)

        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_slots = min(num_computed + num_new_tokens, self.max_model_len)
        num_required = -(-num_slots // self.block_size) - num_held
        if max(num_required, 0) + num_revived > self.block_pool.get_num_free_blocks():
            return None

        # From here on the allocation cannot fail.
        if req_blocks is None:
            req_blocks = self.req_to_blocks[req_id] = []
            self.num_cached_block[req_id] = 0
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
            self.num_cached_block[req_id] = len(req_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_required) if num_required > 0 else []
        if new_blocks:
            req_blocks.extend(new_blocks)

        if self.enable_caching:
            if is_new:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += num_new_computed_tokens
            # Commit only tokens that exist; blocks past num_tokens hold nothing hashable yet.
            self._cache_blocks(request, min(num_computed + num_new_tokens, request.num_tokens))
        return new_blocks

    def allocate_decode_slot(self, request: Request, num_tokens: int) -> list[int] | None:
        """``allocate_slots(request, 1)`` for a running request decoding its next token.

        ``num_tokens`` is the request's token count once this token is computed (its computed
        tokens + 1, which is all of its tokens). The request's blocks hold every computed token,
        so at most one block is added. Returns the ids of the added blocks (often none), or
        None, changing nothing, when no block is free. The block the token completes, if any,
        enters the prefix cache as in ``allocate_slots``.
        """
        req_id = request.request_id
        req_blocks = self.req_to_blocks[req_id]
        new_ids: list[int] = []
        if num_tokens > len(req_blocks) * self.block_size:
            block = self.block_pool.get_new_block()
            if block is None:
                return None
            req_blocks.append(block)
            new_ids.append(block.block_id)
        if self.enable_caching and num_tokens // self.block_size > self.num_cached_block[req_id]:
            self._cache_blocks(request, num_tokens)
        return new_ids

    def _cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Enter the request's blocks that ``num_tokens`` tokens fill into the prefix cache."""
        req_id = request.request_id
        num_cached = self.num_cached_block[req_id]
        # Without a block hasher the request has no hashes and simply never gets cached.
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        if num_full <= num_cached:
            return
        if num_full == num_cached + 1:  # one block, as every decode step that fills one
            self.block_pool.cache_full_block(
                self.req_to_blocks[req_id][num_cached], request.block_hashes[num_cached]
            )
            self.num_cached_block[req_id] = num_full
            return
        self.block_pool.cache_full_blocks(
            self.req_to_blocks[req_id][num_cached:num_full],
            request.block_hashes[num_cached:num_full],
        )
        self.num_cached_block[req_id] = num_full

    def free(self, request: Request) -> None:
        """Release every block of ``request``, tail first (see ``BlockPool.free_blocks``)."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_block.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(request_id, [])

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table as block ids."""
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; False (and nothing changes) while blocks are in use."""
        return self.block_pool.reset_prefix_cache()
