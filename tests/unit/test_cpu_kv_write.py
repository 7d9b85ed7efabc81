"""The C++ KV-cache write (``corefleet_cpu.write_kv_cache_``) against the torch reference."""

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
