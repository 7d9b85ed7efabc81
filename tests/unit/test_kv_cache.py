"""Block pool and KVCacheManager allocation: free queue, slots, usage, decode fast path."""

from __future__ import annotations

import pytest

from corefleet.engine.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from corefleet.engine.core.kv_cache import KVCacheManager, num_blocks_for_memory
from corefleet.engine.request import Request
from tests.unit.kv_cache_helpers import admit, free_ids, ids, make_manager, make_request

# ------------------------------------------------------------------------------ free queue


def test_block_uses_slots() -> None:
    block = KVCacheBlock(3)
    assert not hasattr(block, "__dict__")
    with pytest.raises(AttributeError):
        setattr(block, "color", "red")  # noqa: B010
    assert (block.ref_cnt, block.block_hash) == (0, None)


def test_free_queue_operations_keep_links() -> None:
    blocks = [KVCacheBlock(i) for i in range(6)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.num_free_blocks == 6
    assert queue.popleft() is blocks[0]
    queue.remove(blocks[3])
    assert ids(queue.get_all_free_blocks()) == [1, 2, 4, 5]
    assert blocks[3].prev_free_block is None and blocks[3].next_free_block is None
    queue.append(blocks[3])
    queue.prepend_n([blocks[0]])
    assert ids(queue.get_all_free_blocks()) == [0, 1, 2, 4, 5, 3]
    queue.prepend_n([])
    popped = queue.popleft_n(3)
    assert ids(popped) == [0, 1, 2]
    assert all(b.prev_free_block is None and b.next_free_block is None for b in popped)
    assert queue.num_free_blocks == 3
    queue.prepend_n(popped[1:])  # given order is kept at the front
    queue.prepend_n(popped[:1])  # and a later prepend goes ahead of it
    assert ids(queue.get_all_free_blocks()) == [0, 1, 2, 4, 5, 3]


def test_free_queue_empty_raises() -> None:
    queue = FreeKVCacheBlockQueue([KVCacheBlock(0)])
    queue.popleft()
    with pytest.raises(ValueError, match="No free blocks available"):
        queue.popleft()
    with pytest.raises(ValueError):
        queue.popleft_n(1)
    assert queue.popleft_n(0) == []


# ------------------------------------------------------------------------------ manager


def test_failed_allocation_changes_nothing() -> None:
    manager = make_manager(6)  # 5 usable blocks
    shared = list(range(32))
    first = make_request("a", [*shared, 1])
    admit(manager, first)  # blocks 1, 2 (cached), 3
    manager.free(first)
    hog = make_request("hog", list(range(500, 532)))  # takes 3 (uncached) and 4 (never used)
    assert manager.allocate_slots(hog, 20) is not None
    assert manager.num_free_blocks == 3  # 5 and the cached 2, 1

    big = make_request("big", [*shared, *range(1000, 1060)])  # needs 2 hits + 4 new blocks
    hits, num_hit = manager.get_computed_blocks(big)
    assert num_hit == 32
    pool = manager.block_pool
    state = (
        manager.num_free_blocks,
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        free_ids(manager),
        dict(pool.cached_block_hash_to_block._map),
    )
    assert manager.allocate_slots(big, big.num_tokens - num_hit, num_hit, hits) is None
    assert state == (
        manager.num_free_blocks,
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        free_ids(manager),
        dict(pool.cached_block_hash_to_block._map),
    )
    assert "big" not in manager.req_to_blocks
    # Admissions of "a" (33 tokens) and "hog" (32) counted; the failed attempt was not.
    assert manager.prefix_cache_queries == 65


def test_hit_blocks_in_free_queue_count_against_free_blocks() -> None:
    manager = make_manager(5)  # 4 usable
    prompt = list(range(48))
    first = make_request("a", prompt)
    admit(manager, first)  # 3 blocks, all full; 2 cached (the last one holds the 48th token)
    manager.free(first)
    assert manager.num_free_blocks == 4
    again = make_request("b", [*prompt, *range(100, 120)])  # 68 tokens: 3 hits + 2 new > 4
    hits, num_hit = manager.get_computed_blocks(again)
    assert num_hit == 48
    assert manager.allocate_slots(again, 20, num_hit, hits) is None
    shorter = make_request("c", [*prompt, *range(100, 110)])  # 58 tokens: 3 hits + 1 new
    hits, num_hit = manager.get_computed_blocks(shorter)
    assert manager.allocate_slots(shorter, 10, num_hit, hits) is not None
    assert manager.num_free_blocks == 0


def test_decode_allocates_only_when_last_block_fills_and_caches_it() -> None:
    manager = make_manager()
    req = make_request("a", list(range(30)))
    admit(manager, req)
    assert ids(manager.get_blocks("a")) == [1, 2]
    assert manager.block_pool.blocks[2].block_hash is None
    req.append_output_token_ids(500)  # 31 tokens; computing token 30 needs slot 31
    assert manager.allocate_slots(req, 1) == []
    req.num_computed_tokens += 1
    req.append_output_token_ids(501)  # 32 tokens: block 2 is full once token 31 is computed
    assert manager.allocate_slots(req, 1) == []
    req.num_computed_tokens += 1
    assert manager.block_pool.blocks[2].block_hash == req.block_hashes[1]
    req.append_output_token_ids(502)
    assert ids(manager.allocate_slots(req, 1) or []) == [3]


def test_usage_and_free_counts() -> None:
    manager = make_manager(11)
    assert manager.usage == 0.0 and manager.num_free_blocks == 10
    req = make_request("a", list(range(40)))  # 3 blocks
    admit(manager, req)
    assert manager.usage == pytest.approx(0.3)
    manager.free(req)
    assert manager.usage == 0.0  # cached free blocks count as free
    assert all(b.ref_cnt == 0 for b in manager.block_pool.blocks)


def test_allocate_zero_tokens_rejected() -> None:
    with pytest.raises(ValueError):
        make_manager().allocate_slots(make_request("a", [1, 2]), 0)


def test_null_block_reserved() -> None:
    pool = BlockPool(4, enable_caching=True)
    assert pool.null_block.block_id == 0
    assert pool.get_num_free_blocks() == 3
    assert 0 not in ids(pool.get_new_blocks(3))
    with pytest.raises(ValueError):
        BlockPool(1, enable_caching=True)


def test_num_blocks_for_memory() -> None:
    # 2 (K, V) * 16 tokens * 4 layers * 2 heads * 64 dim * 2 bytes = 32 KiB per block.
    assert num_blocks_for_memory(32 * 1024 * 10 + 5, 16, 4, 2, 64, 2) == 10
    assert num_blocks_for_memory(0, 16, 4, 2, 64, 2) == 0


# --------------------------------------------------------------------- decode fast path


def _decode(manager: KVCacheManager, request: Request, lean: bool) -> list[int] | None:
    """One decode token: the scheduler's lean path or the general allocate_slots."""
    request.append_output_token_ids(1000 + request.num_tokens)
    if lean:
        added = manager.allocate_decode_slot(request, request.num_computed_tokens + 1)
    else:
        blocks = manager.allocate_slots(request, 1)
        added = None if blocks is None else ids(blocks)
    if added is not None:
        request.num_computed_tokens += 1
    return added


@pytest.mark.parametrize("prompt_len", [1, 15, 16, 17, 40])
def test_decode_slot_equals_allocate_slots(prompt_len: int) -> None:
    managers = {lean: make_manager(num_blocks=20) for lean in (True, False)}
    requests = {lean: make_request("r", range(prompt_len)) for lean in (True, False)}
    for lean in (True, False):
        admit(managers[lean], requests[lean])
    for _ in range(50):  # across several block boundaries
        assert _decode(managers[True], requests[True], True) == _decode(
            managers[False], requests[False], False
        )
    lean, general = managers[True], managers[False]
    assert ids(lean.get_blocks("r")) == ids(general.get_blocks("r"))
    assert lean.num_cached_block == general.num_cached_block
    assert free_ids(lean) == free_ids(general)
    assert [b.block_hash for b in lean.get_blocks("r")] == [
        b.block_hash for b in general.get_blocks("r")
    ]


def test_decode_slot_without_a_free_block_changes_nothing() -> None:
    manager = make_manager(num_blocks=3)  # two usable blocks
    request = make_request("r", range(32))
    admit(manager, request)
    held = ids(manager.get_blocks("r"))
    request.append_output_token_ids(7)
    assert manager.allocate_decode_slot(request, 33) is None
    assert ids(manager.get_blocks("r")) == held and manager.num_free_blocks == 0
    assert manager.num_cached_block["r"] == 2


def test_get_new_block_takes_the_same_block_as_get_new_blocks() -> None:
    """The single-block path evicts a cached block exactly as the general one does."""
    pools = [BlockPool(4, enable_caching=True) for _ in range(2)]
    for pool in pools:  # block 1 cached and freed: it sits at the back of the queue
        cached = pool.get_new_blocks(1)
        pool.cache_full_block(cached[0], b"h")
        pool.free_blocks(cached)
        pool.get_new_blocks(2)  # blocks 2 and 3: the cached block is next
    one = pools[0].get_new_block()
    (general,) = pools[1].get_new_blocks(1)
    assert one is not None and one.block_id == general.block_id == 1
    for pool, block in zip(pools, (one, general), strict=True):
        assert block.ref_cnt == 1 and block.block_hash is None
        assert pool.get_cached_block(b"h") is None  # evicted on the way out
    assert pools[0].get_new_block() is None  # nothing free: None, nothing changes
    assert pools[0].get_num_free_blocks() == 0
