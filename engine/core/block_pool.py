"""The physical KV-cache blocks: a free queue with LRU eviction and the prefix-cache hash map.

Eviction order is the order of the free queue, front first:

- a block freed *without* a hash (a partial block, or caching off) goes to the front, so it is
  reused at once: it holds nothing anybody can hit;
- a block freed *with* a hash goes to the back, so cached blocks are evicted least recently
  used first, and their hashes stay valid (a later request can revive them with ``touch``)
  until the block is actually handed out again (lazy eviction).
"""

from __future__ import annotations

from collections.abc import Iterable

from corefleet.engine.core.block_hash import BlockHash


class KVCacheBlock:
    """One fixed-size block of KV-cache slots, identified by its index in the cache tensors."""

    __slots__ = ("block_hash", "block_id", "next_free_block", "prev_free_block", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0  # requests holding this block
        self.block_hash: BlockHash | None = None  # set while the block is in the prefix cache
        # Links of the free queue; both None while the block is not in it.
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:
        digest = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={digest})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks with O(1) removal from anywhere.

    A deque cannot remove a block from the middle cheaply, which ``touch`` needs when a prefix
    hit revives a cached free block. Two sentinel nodes (id -1) remove all edge cases.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        # Link the initial blocks in one tight loop: pools of 100k+ blocks are common on GPUs.
        prev = self._head
        count = 0
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
            count += 1
        prev.next_free_block = self._tail
        self._tail.prev_free_block = prev
        self.num_free_blocks = count

    def popleft(self) -> KVCacheBlock:
        """Remove and return the front block (the next one to reuse)."""
        block = self._head.next_free_block
        if block is None or block is self._tail:
            raise ValueError("No free blocks available")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the ``n`` front blocks, in queue order."""
        if n > self.num_free_blocks:
            raise ValueError(f"cannot pop {n} blocks: only {self.num_free_blocks} free")
        out: list[KVCacheBlock] = []
        block = self._head.next_free_block
        for _ in range(n):
            assert block is not None
            out.append(block)
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = nxt
        assert block is not None
        self._head.next_free_block = block
        block.prev_free_block = self._head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from wherever it is in the queue."""
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the back (evicted last)."""
        last = self._tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Put ``blocks`` at the back in their given order."""
        for block in blocks:
            self.append(block)

    def prepend(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the front (reused first)."""
        first = self._head.next_free_block
        assert first is not None
        block.prev_free_block = self._head
        block.next_free_block = first
        first.prev_free_block = block
        self._head.next_free_block = block
        self.num_free_blocks += 1

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        """Put ``blocks`` at the front, keeping their given order (``blocks[0]`` first)."""
        for block in reversed(blocks):
            self.prepend(block)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Walk the queue front to back (tests and debugging; O(n))."""
        out: list[KVCacheBlock] = []
        block = self._head.next_free_block
        while block is not None and block is not self._tail:
            out.append(block)
            block = block.next_free_block
        return out


class BlockHashToBlockMap:
    """Hash → cached block(s). Identical blocks are kept side by side, not de-duplicated.

    Two requests can fill blocks with identical content in the same step before either is
    cached. Merging them would change a running request's block table, so both stay cached and
    lookups return either one.
    """

    def __init__(self) -> None:
        # One block in the common case; a dict {block_id: block} only for duplicates.
        self._map: dict[BlockHash, KVCacheBlock | dict[int, KVCacheBlock]] = {}

    def __len__(self) -> int:
        return len(self._map)

    def get_one_block(self, key: BlockHash) -> KVCacheBlock | None:
        entry = self._map.get(key)
        if entry is None or isinstance(entry, KVCacheBlock):
            return entry
        return next(iter(entry.values()))

    def insert(self, key: BlockHash, block: KVCacheBlock) -> None:
        entry = self._map.get(key)
        if entry is None:
            self._map[key] = block
        elif isinstance(entry, KVCacheBlock):
            self._map[key] = {entry.block_id: entry, block.block_id: block}
        else:
            entry[block.block_id] = block

    def pop(self, key: BlockHash, block_id: int) -> KVCacheBlock | None:
        """Remove only the block ``block_id`` under ``key``; the key goes with its last block."""
        entry = self._map.get(key)
        if entry is None:
            return None
        if isinstance(entry, KVCacheBlock):
            if entry.block_id != block_id:
                return None
            del self._map[key]
            return entry
        block = entry.pop(block_id, None)
        if len(entry) == 1:
            self._map[key] = next(iter(entry.values()))
        elif not entry:
            del self._map[key]
        return block

    def clear(self) -> None:
        self._map.clear()


class BlockPool:
    """All KV blocks of one cache: allocation, reference counts and the prefix cache.

    Block 0 is the null block, never handed out, so ``num_blocks - 1`` blocks are usable.
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be at least 2 (block 0 is reserved), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self.null_block = self.free_block_queue.popleft()

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks held by requests (cached free blocks count as free)."""
        return 1.0 - self.free_block_queue.num_free_blocks / (self.num_blocks - 1)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get_one_block(block_hash)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` blocks from the front of the free queue, each with ``ref_cnt`` 1.

        A cached block taken here loses its hash now: this is where eviction happens.
        """
        blocks = self.free_block_queue.popleft_n(n)
        for block in blocks:
            if block.block_hash is not None:
                self.cached_block_hash_to_block.pop(block.block_hash, block.block_id)
                block.block_hash = None
            block.ref_cnt = 1
        return blocks

    def get_new_block(self) -> KVCacheBlock | None:
        """``get_new_blocks(1)`` without the list, or None when no block is free."""
        queue = self.free_block_queue
        if not queue.num_free_blocks:
            return None
        block = queue.popleft()
        if block.block_hash is not None:
            self.cached_block_hash_to_block.pop(block.block_hash, block.block_id)
            block.block_hash = None
        block.ref_cnt = 1
        return block

    def cache_full_blocks(self, blocks: list[KVCacheBlock], hashes: list[BlockHash]) -> None:
        """Enter newly full blocks into the prefix cache under their hashes."""
        for block, block_hash in zip(blocks, hashes, strict=True):
            self.cache_full_block(block, block_hash)

    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Enter one newly full block into the prefix cache under its hash."""
        assert block.block_hash is None, f"{block} is already cached"
        block.block_hash = block_hash
        self.cached_block_hash_to_block.insert(block_hash, block)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks, reviving any that sit in the free queue."""
        for block in blocks:
            if block.ref_cnt == 0 and block is not self.null_block:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; blocks reaching 0 return to the free queue.

        Pass a request's blocks tail first: cached blocks are appended in that order, so the
        end of a prefix chain is evicted before its start (the start is the likeliest to hit).
        """
        uncached: list[KVCacheBlock] = []
        for block in ordered_blocks:
            if block is self.null_block:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    uncached.append(block)
                else:
                    self.free_block_queue.append(block)
        if uncached:
            self.free_block_queue.prepend_n(uncached)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any request holds a block."""
        if self.free_block_queue.num_free_blocks != self.num_blocks - 1:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.block_hash = None
        return True
