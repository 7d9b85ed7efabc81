"""Prefix caching: block hashes, cache salts, hits, eviction order and counters."""

from __future__ import annotations

from corefleet.engine.core.block_hash import NONE_HASH, hash_block_tokens
from corefleet.engine.core.block_pool import BlockHashToBlockMap, KVCacheBlock
from tests.unit.kv_cache_helpers import admit, free_ids, ids, make_manager, make_request

# ------------------------------------------------------------------------------ hashing


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
