"""The C++ KV-cache write (``corefleet_cpu.write_kv_cache_``), alone and fused with the rotary
embedding and the casts (``rotary_to_cache``), against the torch reference."""

from __future__ import annotations

import pytest
import torch

from corefleet.kernels import reference
from corefleet.kernels.cpu import backend as cpu_backend
from tests.cpu_ops_support import load_cpu_ops_or_skip

OPS = load_cpu_ops_or_skip()


def _fused_qkv_views(
    num_tokens: int, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """key, value [T, 3, 64] as the model makes them: views into a fused [T, q + 2kv] tensor."""
    qkv = torch.randn(num_tokens, 9 * 64 + 2 * 3 * 64, generator=gen).to(dtype)
    _, k, v = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)
    return k.view(num_tokens, 3, 64), v.view(num_tokens, 3, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 5, 40])
def test_matches_reference(dtype: torch.dtype, num_tokens: int) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    key, value = _fused_qkv_views(num_tokens, dtype, gen)
    slots = torch.randperm(10 * 16, generator=gen)[:num_tokens]  # scattered, distinct
    caches = [torch.randn(10, 16, 3, 64, generator=gen).to(dtype) for _ in range(2)]
    expected = [c.clone() for c in caches]
    reference.write_kv_cache(key, value, expected[0], expected[1], slots)
    cpu_backend.CpuBackend().write_kv_cache(key, value, *caches, slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


@pytest.mark.parametrize("bad_slot", [-1, 160, 10**12])
def test_a_bad_slot_raises_and_writes_nothing(bad_slot: int) -> None:
    gen = torch.Generator().manual_seed(0)
    key, value = _fused_qkv_views(3, torch.float32, gen)
    k_cache, v_cache = torch.zeros(10, 16, 3, 64), torch.zeros(10, 16, 3, 64)
    slots = torch.tensor([4, 7, bad_slot])  # the valid tokens come first
    with pytest.raises(RuntimeError, match=r"slot_mapping\[2\] = .* is outside \[0, 160\)"):
        OPS.write_kv_cache_(key, value, k_cache, v_cache, slots)
    assert not k_cache.any() and not v_cache.any()


def test_rejects_a_dtype_other_than_the_cache() -> None:
    gen = torch.Generator().manual_seed(0)
    key, value = _fused_qkv_views(2, torch.float32, gen)
    k_cache = torch.zeros(4, 16, 3, 64, dtype=torch.bfloat16)
    v_cache = torch.zeros(4, 16, 3, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="share a dtype"):
        OPS.write_kv_cache_(key, value, k_cache, v_cache, torch.tensor([0, 1]))


def _rotary(num_tokens: int, dtype: torch.dtype, gen: torch.Generator) -> list[torch.Tensor]:
    """cos, sin [T, 1, 64] of random positions, laid out as the model passes them (random
    values stand in for the angles: only equality is tested)."""
    cache = torch.randn(4096, 64, generator=gen)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen)
    return list(reference.rotary_cos_sin(positions, cache, dtype))


@pytest.mark.parametrize(
    ("dtype", "cache_dtype"),
    [
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
    ],
)
@pytest.mark.parametrize("num_tokens", [1, 7, 40])
def test_rotary_to_cache_is_the_unfused_ops_bit_for_bit(
    dtype: torch.dtype, cache_dtype: torch.dtype, num_tokens: int
) -> None:
    """The fused op (split, rotary, casts, cache write in one call) gives exactly the values,
    the cache contents and the dtypes of those steps made one by one."""
    gen = torch.Generator().manual_seed(num_tokens)
    qkv = torch.randn(num_tokens, 9 * 64 + 2 * 3 * 64, generator=gen).to(dtype)
    cos, sin = _rotary(num_tokens, dtype, gen)
    slots = torch.randperm(10 * 16, generator=gen)[:num_tokens]
    caches = [torch.randn(10, 16, 3, 64, generator=gen).to(cache_dtype) for _ in range(2)]
    expected_caches = [c.clone() for c in caches]
    cpu = cpu_backend.CpuBackend()
    # The base class's composition on the CPU backend: its rotary_ and cache write, torch casts.
    unfused = cpu_backend.KernelBackend.rotary_to_cache
    expected = unfused(cpu, qkv.clone(), cos, sin, *expected_caches, slots, 9, 3)
    got = cpu.rotary_to_cache(qkv, cos, sin, *caches, slots, 9, 3)
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == cache_dtype and g.shape == e.shape and torch.equal(g, e)
    assert torch.equal(caches[0], expected_caches[0]) and torch.equal(caches[1], expected_caches[1])


def test_rotary_to_cache_with_a_bad_slot_raises_and_writes_nothing() -> None:
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(2, 9 * 64 + 2 * 3 * 64, generator=gen)
    cos, sin = _rotary(2, torch.float32, gen)
    k_cache = torch.zeros(10, 16, 3, 64, dtype=torch.bfloat16)
    v_cache = torch.zeros(10, 16, 3, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"slot_mapping\[1\] = .* is outside \[0, 160\)"):
        OPS.rotary_to_cache(qkv, cos, sin, k_cache, v_cache, torch.tensor([3, 10**9]), 9, 3)
    assert not k_cache.any() and not v_cache.any()


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(8, 3), (9, 2), (0, 3)])
def test_rotary_to_cache_refuses_heads_that_do_not_match(num_heads: int, num_kv_heads: int) -> None:
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(2, 9 * 64 + 2 * 3 * 64, generator=gen)
    cos, sin = _rotary(2, torch.float32, gen)
    caches = [torch.zeros(10, 16, 3, 64) for _ in range(2)]
    with pytest.raises(RuntimeError, match="rotary_to_cache: qkv must be"):
        OPS.rotary_to_cache(qkv, cos, sin, *caches, torch.tensor([0, 1]), num_heads, num_kv_heads)
    assert not caches[0].any()
