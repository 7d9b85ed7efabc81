"""The fused C++ layer ops (RMSNorm, rotary, SiLU-and-mul) against the torch reference."""

from __future__ import annotations

import pytest
import torch

from corefleet.kernels import reference
from corefleet.kernels.cpu import backend as cpu_backend
from tests.cpu_ops_support import load_cpu_ops_or_skip

OPS = load_cpu_ops_or_skip()

DTYPES = [torch.float32, torch.bfloat16]
# bfloat16: the fused ops round once where the reference's separate ops may round twice.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-2)}
SHAPES = [(1, 576), (7, 576), (64, 40), (300, 1024)]  # rows; hidden with and without a tail


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    rtol, atol = TOLERANCE[expected.dtype]
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "hidden"), SHAPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype: torch.dtype, rows: int, hidden: int, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(rows + hidden)
    x = torch.randn(rows, hidden, generator=gen).to(dtype)  # [T, H]
    residual = torch.randn(rows, hidden, generator=gen).to(dtype) if with_residual else None
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)  # [H]
    expected, expected_residual = reference.rms_norm(x, weight, 1e-5, residual)
    normed, new_residual = OPS.rms_norm(x, residual, weight, 1e-5)
    _close(normed, expected)
    assert torch.equal(new_residual, expected_residual)  # the add is rounded exactly as torch's
    assert new_residual.data_ptr() != x.data_ptr()  # never an alias the next layer could clobber


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("tokens", "num_heads", "num_kv_heads", "head_dim"),
    [(1, 9, 3, 64), (37, 8, 2, 128), (5, 4, 4, 16)],
)
def test_rotary_in_place_on_a_fused_projection(
    dtype: torch.dtype, tokens: int, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    gen = torch.Generator().manual_seed(tokens)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(tokens, q_size + 2 * kv_size, generator=gen).to(dtype)  # [T, q + 2kv]
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(tokens, num_heads, head_dim)  # strided rows, as in the model
    k = k.view(tokens, num_kv_heads, head_dim)
    v_before = v.clone()
    cache = torch.randn(4096, head_dim, generator=gen)  # [max_pos, D] float32
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    cos, sin = reference.rotary_cos_sin(positions, cache, dtype)  # [T, 1, D]
    expected_q, expected_k = reference.apply_rotary(q.clone(), k.clone(), cos, sin)
    OPS.rotary_(q, k, cos, sin)
    _close(q, expected_q)
    _close(k, expected_k)
    assert torch.equal(v, v_before)  # the value part of the projection is untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "hidden"), SHAPES)
def test_silu_and_mul(dtype: torch.dtype, rows: int, hidden: int) -> None:
    gen = torch.Generator().manual_seed(rows * hidden)
    x = (4 * torch.randn(rows, 2 * hidden, generator=gen)).to(dtype)  # [T, 2I], wide range
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's clamps and signed zero
    _close(OPS.silu_and_mul(x), reference.silu_and_mul(x))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: OPS.rms_norm(torch.randn(2, 8), None, torch.ones(7), 1e-5), "weight"),
        (
            lambda: OPS.rms_norm(torch.randn(2, 8).double(), None, torch.ones(8).double(), 1e-5),
            "float32 and bfloat16",
        ),
        (
            lambda: OPS.rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.ones(8), 1e-5),
            "residual",
        ),
        (lambda: OPS.silu_and_mul(torch.randn(2, 7)), "2I"),
        (
            lambda: OPS.rotary_(
                torch.randn(2, 2, 8), torch.randn(3, 2, 8), torch.randn(2, 8), torch.randn(2, 8)
            ),
            "disagree",
        ),
        (
            lambda: OPS.rotary_(
                torch.randn(2, 2, 8),
                torch.randn(2, 2, 8),
                torch.randn(2, 8).bfloat16(),
                torch.randn(2, 8),
            ),
            "dtype",
        ),
    ],
)
def test_bad_arguments_are_refused(call: object, message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        call()  # type: ignore[operator]


def test_backend_model_ops_match_the_torch_backend() -> None:
    """What the model calls: the CPU backend's answers equal the reference backend's."""
    from corefleet.kernels.backend import KernelBackend

    cpu, ref = cpu_backend.CpuBackend(), KernelBackend()
    gen = torch.Generator().manual_seed(0)
    x, res, w = (torch.randn(5, 64, generator=gen) for _ in range(3))
    got = cpu.rms_norm(x, w[0], 1e-6, res)
    want = ref.rms_norm(x, w[0], 1e-6, res)
    _close(got[0], want[0])
    _close(got[1], want[1])
    _close(cpu.silu_and_mul(torch.cat([x, res], 1)), ref.silu_and_mul(torch.cat([x, res], 1)))
