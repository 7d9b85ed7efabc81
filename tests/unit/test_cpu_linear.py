"""The C++ small-batch linear (``corefleet_cpu.small_linear``) against ``torch.nn.functional``."""

from __future__ import annotations

import pytest
import torch

from corefleet.kernels.cpu import backend as cpu_backend
from tests.cpu_ops_support import load_cpu_ops_or_skip

OPS = load_cpu_ops_or_skip()

# float32 differs from torch's GEMM only in summation order; bfloat16 outputs are rounded once
# from float32 sums here and by oneDNN there, so they can differ by an ulp of the output.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 1e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 16, 31, 64])  # every x-row remainder
# Full and partial 8-row tiles; bands (one per thread, 64 rows or more) that split into eight
# sub-bands evenly (960) or with rows left over (129, 1003).
@pytest.mark.parametrize("out_features", [1, 7, 8, 13, 129, 960, 1003])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_torch_linear(
    dtype: torch.dtype, rows: int, out_features: int, with_bias: bool
) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, 576, generator=gen).to(dtype)  # [M, K]
    weight = torch.randn(out_features, 576, generator=gen).to(dtype)  # [N, K]
    bias = torch.randn(out_features, generator=gen).to(dtype) if with_bias else None  # [N]
    expected = torch.nn.functional.linear(
        x.float(), weight.float(), None if bias is None else bias.float()
    )
    actual = OPS.small_linear(x, weight, bias)
    assert actual.shape == (rows, out_features) and actual.dtype == dtype
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(
        actual.float(), expected.to(dtype).float(), rtol=rtol, atol=atol * 24
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [5, 37])  # outputs stored one by one; in vector runs
def test_nan_in_an_x_row_stays_in_its_output_row(dtype: torch.dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(rows, 576, generator=gen).to(dtype)  # [M, K]
    weight = torch.randn(100, 576, generator=gen).to(dtype)  # [N, K]
    bias = torch.randn(100, generator=gen).to(dtype)  # [N]
    x[rows - 2, 10] = float("nan")
    out = OPS.small_linear(x, weight, bias)
    assert out[rows - 2].isnan().all()
    others = torch.cat([out[: rows - 2], out[rows - 1 :]])
    expected = torch.nn.functional.linear(
        torch.cat([x[: rows - 2], x[rows - 1 :]]).float(), weight.float(), bias.float()
    )
    torch.testing.assert_close(others.float(), expected, atol=0.1, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [5, 37])  # tiles from sub-bands; tiles of adjacent rows
def test_result_does_not_depend_on_thread_count(dtype: torch.dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 1536, generator=gen).to(dtype)  # [M, K]: 3-row passes, a remainder
    weight = torch.randn(4099, 1536, generator=gen).to(dtype)  # [N, K]: uneven bands
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = OPS.small_linear(x, weight, None)
        torch.set_num_threads(max(2, before))
        multi = OPS.small_linear(x, weight, None)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(single, multi)


@pytest.mark.parametrize("rows", [1, 5, 37])
def test_bfloat16_with_k_not_a_multiple_of_32(rows: int) -> None:
    """K = 48: bfloat16 pairs (K % 32 == 0) do not fit, the weights are widened instead."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 48, generator=gen).bfloat16()  # [M, K]
    weight = torch.randn(129, 48, generator=gen).bfloat16()  # [N, K]
    expected = torch.nn.functional.linear(x.float(), weight.float()).bfloat16().float()
    rtol, atol = TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(
        OPS.small_linear(x, weight, None).float(), expected, rtol=rtol, atol=atol * 8
    )


@pytest.mark.parametrize(
    ("x", "weight", "message"),
    [
        (torch.randn(65, 32), torch.randn(4, 32), "at most 64 rows"),
        (torch.randn(2, 32), torch.randn(4, 48), "disagree on K"),
        (torch.randn(2, 32), torch.randn(4, 32).bfloat16(), "share a dtype"),
        (torch.randn(2, 32).double(), torch.randn(4, 32).double(), "float32 and bfloat16"),
        (torch.randn(32, 2).t(), torch.randn(4, 32), "contiguous"),
    ],
)
def test_rejects_bad_arguments(x: torch.Tensor, weight: torch.Tensor, message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        OPS.small_linear(x, weight, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 4, 9, 64, 65])
def test_backend_linear_any_batch(dtype: torch.dtype, rows: int) -> None:
    """The backend's dispatch (C++ for a few rows, torch above) gives torch's answer."""
    backend = cpu_backend.CpuBackend()
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 40, generator=gen).to(dtype)  # K = 40: not a multiple of 16
    weight = torch.randn(24, 40, generator=gen).to(dtype)
    torch.testing.assert_close(
        backend.linear(x, weight, None), torch.nn.functional.linear(x, weight)
    )
    x = torch.randn(rows, 64, generator=gen).to(dtype)
    weight = torch.randn(24, 64, generator=gen).to(dtype)
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(
        backend.linear(x, weight, None).float(),
        torch.nn.functional.linear(x.float(), weight.float()).to(dtype).float(),
        rtol=rtol,
        atol=atol * 8,
    )
