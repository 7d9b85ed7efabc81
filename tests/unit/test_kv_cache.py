"""Block pool, prefix-cache hashing and KVCacheManager: allocation, hits, eviction order."""

from __future__ import annotations

import pytest

from corefleet.engine.core.block_hash import NONE_HASH, hash_block_tokens, make_block_hasher
from corefleet.engine.core.block_pool import (
    BlockHashToBlockMap,
    BlockPool,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
)
from corefleet.engine.core.kv_cache import KVCacheManager, num_blocks_for_memory
from corefleet.engine.messages import SamplingParams
from corefleet.engine.request import Request

BS = 16


def make_request(
    req_id: str, tokens: list[int], *, salt: str | None = None, block_size: int = BS
) -> Request:
    return Request(
        req_id,
        list(tokens),
        SamplingParams(max_tokens=100),
        eos_token_id=None,
        cache_salt=salt,
        block_hasher=make_block_hasher(block_size),
    )


def make_manager(num_blocks: int = 11, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, enable_caching=caching, max_model_len=8192)


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def free_ids(manager: KVCacheManager) -> list[int]:
    return ids(manager.block_pool.free_block_queue.get_all_free_blocks())


def admit(manager: KVCacheManager, request: Request) -> tuple[list[KVCacheBlock], int]:
    """Schedule the whole remaining prompt of a new request, as the scheduler does."""
    hits, num_hit = manager.get_computed_blocks(request)
    new = manager.allocate_slots(request, request.num_tokens - num_hit, num_hit, hits)
    assert new is not None
    request.num_computed_tokens = request.num_tokens
    return hits, num_hit


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


def test_hash_map_keeps_duplicates_and_pops_by_block_id() -> None:
    table = BlockHashToBlockMap()
    a, b = KVCacheBlock(1), KVCacheBlock(2)
    table.insert(b"h", a)
    table.insert(b"h", b)
    assert table.get_one_block(b"h") in (a, b)
    assert table.pop(b"h", 99) is None  # mismatched id: nothing happens
    assert table.pop(b"h", 1) is a
    assert table.get_one_block(b"h") is b
    assert table.pop(b"h", 2) is b
    assert table.get_one_block(b"h") is None and len(table) == 0


# ------------------------------------------------------------------------------ hashing


def test_block_hasher_hashes_full_blocks_chained() -> None:
    tokens = list(range(40))
    request = make_request("r", tokens)
    h0 = hash_block_tokens(None, tokens[:16])
    h1 = hash_block_tokens(h0, tokens[16:32])
    assert request.block_hashes == [h0, h1]  # the partial third block is not hashed
    assert h0 == hash_block_tokens(NONE_HASH, tokens[:16])
    for t in range(7):
        request.append_output_token_ids(100 + t)
    assert len(request.block_hashes) == 2  # 47 tokens
    request.append_output_token_ids(200)
    assert request.block_hashes[2] == hash_block_tokens(h1, [*tokens[32:], *range(100, 107), 200])
    # Deterministic across calls (and processes: no pickle, no random seed).
    assert make_request("other", tokens).block_hashes == [h0, h1]


def test_cache_salt_only_in_first_block_but_separates_the_chain() -> None:
    tokens = list(range(32))
    salted = make_request("a", tokens, salt="tenant-1")
    plain = make_request("b", tokens)
    h0 = hash_block_tokens(None, tokens[:16], ("tenant-1",))
    assert salted.block_hashes == [h0, hash_block_tokens(h0, tokens[16:])]
    assert not set(salted.block_hashes) & set(plain.block_hashes)


def test_cache_salt_hits_same_salt_only() -> None:
    manager = make_manager()
    prompt = list(range(50))
    admit(manager, make_request("a", prompt, salt="s1"))
    assert manager.get_computed_blocks(make_request("b", prompt, salt="s1"))[1] == 48
    assert manager.get_computed_blocks(make_request("c", prompt, salt="s2"))[1] == 0
    assert manager.get_computed_blocks(make_request("d", prompt))[1] == 0


# ------------------------------------------------------------------------------ manager


def test_worked_eviction_example() -> None:
    """A worked eviction example: block_size 16, 11 blocks (10 usable)."""
    manager = make_manager(11)
    common = list(range(48))
    req0 = make_request("0", [*common, *range(100, 107)])  # 3 full blocks + 7 tokens
    assert admit(manager, req0) == ([], 0)
    blocks0 = manager.get_blocks("0")
    assert ids(blocks0) == [1, 2, 3, 4]
    assert [b.block_hash for b in blocks0[:3]] == req0.block_hashes
    assert blocks0[3].block_hash is None

    req1 = make_request("1", [*common, *range(200, 205)])
    hits, num_hit = admit(manager, req1)
    assert (ids(hits), num_hit) == ([1, 2, 3], 48)
    assert ids(manager.get_blocks("1")) == [1, 2, 3, 5]
    assert [b.ref_cnt for b in blocks0] == [2, 2, 2, 1]

    manager.free(req0)
    manager.free(req1)
    assert free_ids(manager) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]

    req2 = make_request("2", [*common, *range(300, 303)])
    hits, num_hit = admit(manager, req2)
    assert (ids(hits), num_hit) == ([1, 2, 3], 48)
    assert ids(manager.get_blocks("2")) == [1, 2, 3, 5]
    assert manager.num_free_blocks == 6  # touched cached blocks left the free queue at once
    manager.free(req2)

    miss = make_request("3", list(range(1000, 1160)))  # 10 full blocks, no hit
    admit(manager, miss)
    assert ids(manager.get_blocks("3")) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    assert manager.num_free_blocks == 0
    # Reusing cached blocks evicted their old hashes (lazily, at reuse), then cached the new ones.
    assert manager.get_computed_blocks(make_request("4", [*common, 1]))[1] == 0


def test_prefix_hit_stops_at_first_miss() -> None:
    manager = make_manager()
    a = list(range(64))
    admit(manager, make_request("a", a))
    b = list(a)
    b[20] = 9999  # second block differs; blocks 3-4 equal by token but not by chained hash
    hits, num_hit = manager.get_computed_blocks(make_request("b", b))
    assert (ids(hits), num_hit) == ([1], 16)


def test_prefix_hit_stops_at_first_miss_even_if_later_blocks_are_cached() -> None:
    manager = make_manager()
    prompt = list(range(64))
    first = make_request("a", prompt)
    admit(manager, first)
    manager.free(first)
    middle = manager.block_pool.blocks[2]  # evict the second block's hash only
    assert middle.block_hash is not None
    manager.block_pool.cached_block_hash_to_block.pop(middle.block_hash, 2)
    middle.block_hash = None
    hits, num_hit = manager.get_computed_blocks(make_request("b", prompt))
    assert (ids(hits), num_hit) == ([1], 16)


def test_full_hit_recomputes_last_token() -> None:
    manager = make_manager()
    prompt = list(range(48))  # exactly three blocks
    admit(manager, make_request("a", prompt))
    assert manager.get_computed_blocks(make_request("b", prompt))[1] == 32
    assert manager.get_computed_blocks(make_request("c", [*prompt, 7]))[1] == 48


def test_get_computed_blocks_does_not_touch() -> None:
    manager = make_manager()
    prompt = list(range(40))
    req = make_request("a", prompt)
    admit(manager, req)
    manager.free(req)
    before = manager.num_free_blocks
    hits, _ = manager.get_computed_blocks(make_request("b", prompt))
    assert [b.ref_cnt for b in hits] == [0, 0]
    assert manager.num_free_blocks == before


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


def test_touch_revives_cached_free_blocks() -> None:
    manager = make_manager()
    prompt = list(range(40))
    req = make_request("a", prompt)
    admit(manager, req)
    manager.free(req)
    block1 = manager.block_pool.blocks[1]
    assert block1.ref_cnt == 0 and block1.block_hash is not None
    assert 1 in free_ids(manager)
    admit(manager, make_request("b", prompt))
    assert block1.ref_cnt == 1
    assert 1 not in free_ids(manager)
    assert manager.get_block_ids("b")[:2] == [1, 2]


def test_reused_cached_block_loses_its_hash() -> None:
    manager = make_manager(3)  # 2 usable
    req = make_request("a", list(range(20)))
    admit(manager, req)
    manager.free(req)
    old_hash = req.block_hashes[0]
    other = make_request("b", list(range(100, 130)))
    assert ids(manager.allocate_slots(other, 20) or []) == [2, 1]  # uncached block 2 first
    assert manager.block_pool.get_cached_block(old_hash) is None
    # Block 2 now holds b's first full block; block 1 is partial and carries no hash.
    assert [b.block_hash for b in manager.get_blocks("b")] == [other.block_hashes[0], None]


def test_reset_prefix_cache() -> None:
    manager = make_manager()
    req = make_request("a", list(range(40)))
    admit(manager, req)
    assert not manager.reset_prefix_cache()
    assert manager.block_pool.get_cached_block(req.block_hashes[0]) is not None
    manager.free(req)
    assert manager.reset_prefix_cache()
    assert manager.block_pool.get_cached_block(req.block_hashes[0]) is None
    assert all(b.block_hash is None for b in manager.block_pool.blocks)


def test_usage_and_free_counts() -> None:
    manager = make_manager(11)
    assert manager.usage == 0.0 and manager.num_free_blocks == 10
    req = make_request("a", list(range(40)))  # 3 blocks
    admit(manager, req)
    assert manager.usage == pytest.approx(0.3)
    manager.free(req)
    assert manager.usage == 0.0  # cached free blocks count as free
    assert all(b.ref_cnt == 0 for b in manager.block_pool.blocks)


def test_caching_disabled_never_hits_and_reuses_lifo() -> None:
    manager = make_manager(4, caching=False)  # 3 usable
    prompt = list(range(40))
    req = make_request("a", prompt)
    admit(manager, req)
    assert all(b.block_hash is None for b in manager.get_blocks("a"))
    assert manager.get_computed_blocks(make_request("b", prompt)) == ([], 0)
    assert manager.allocate_slots(make_request("c", [1]), 1) is None
    manager.free(req)
    assert free_ids(manager) == [3, 2, 1]
    assert manager.prefix_cache_queries == 0


def test_prefix_cache_counters() -> None:
    manager = make_manager()
    prompt = list(range(40))
    admit(manager, make_request("a", prompt))
    second = make_request("b", prompt)
    admit(manager, second)
    second.append_output_token_ids(1)
    assert manager.allocate_slots(second, 1) is not None  # a decode step is not a lookup
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (80, 32)


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
