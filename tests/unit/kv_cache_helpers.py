"""Builders shared by the KV cache tests: requests, managers, block ids and admission."""

from __future__ import annotations

from corefleet.engine.core.block_hash import make_block_hasher
from corefleet.engine.core.block_pool import KVCacheBlock
from corefleet.engine.core.kv_cache import KVCacheManager
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
