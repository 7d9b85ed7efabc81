"""The GGUF Triton kernels against the ``gguf`` package's dequantization, under the interpreter.

Every format, float32 and bfloat16, M = 1 (decode), 3, 16 and 33 (two interpreter row tiles),
67 outputs (two column tiles, the second partial), K of one to three K-quant blocks (several K
tiles, each half a block) or one to nine 32-value blocks (a last K tile only partly inside the
row). The oracle is ``F.linear(x, W)`` with ``W`` from ``gguf.quants.dequantize``; the
dequantize kernel must equal it bit for bit in float32.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from corefleet.kernels.backend import KernelBackend
from corefleet.kernels.gguf_quant import QuantFormat
from corefleet.kernels.triton_ops import gguf_matmul
from corefleet.kernels.triton_ops.backend import TritonBackend
from tests.gguf_blocks import ALL_FORMATS, oracle_dequantize, random_qweight
from tests.kernel_cases import require_interpreted_kernels

require_interpreted_kernels()

N = 67
# (M, blocks of a K-quant row, blocks of a 32-value row, bias): each M with its own K and bias.
CASES = [(1, 3, 9, True), (3, 1, 1, False), (16, 2, 5, True), (33, 2, 3, False)]
# Relative to the largest output. float32: summation order only. bfloat16: the reference rounds
# W to bfloat16 to nearest even, the interpreter by truncation (GPUs round to nearest even),
# one bf16 step on every weight, accumulated over up to 768 products.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _weight(fmt: QuantFormat, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random ``fmt`` weight ``[n, k]``: its bytes and the oracle's float32 values."""
    raw = random_qweight(fmt, n, k, seed=seed)
    return torch.from_numpy(raw), oracle_dequantize(raw, fmt)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tol = TOLERANCE[expected.dtype] * expected.abs().max().item()
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "k_quant_blocks", "small_blocks", "with_bias"), CASES)
@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.name)
def test_linear_matches_oracle(
    fmt: QuantFormat,
    m: int,
    k_quant_blocks: int,
    small_blocks: int,
    with_bias: bool,
    dtype: torch.dtype,
) -> None:
    k = fmt.block_elems * (k_quant_blocks if fmt.block_elems == 256 else small_blocks)
    qweight, weight = _weight(fmt, N, k, seed=m)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(N, generator=gen).to(dtype) if with_bias else None
    expected = F.linear(x, weight.to(dtype), bias)
    _assert_close(gguf_matmul.gguf_linear(x, qweight, fmt, bias), expected)


@pytest.mark.parametrize("m", [1, 33, 100])  # the GPU's decode, middle and prefill tiles
@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.name)
def test_gpu_tiles_under_the_interpreter(
    fmt: QuantFormat, m: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The tiles a GPU takes for m rows, here: narrow column tiles, K tiles of 64-256 values.
    block_m, block_n, block_k, _, _ = gguf_matmul._gpu_tiles(m)
    monkeypatch.setattr(gguf_matmul, "_INTERPRETER_M", block_m)
    monkeypatch.setattr(gguf_matmul, "_INTERPRETER_N", block_n)
    monkeypatch.setattr(gguf_matmul, "_INTERPRETER_K", block_k)
    k = 2 * fmt.block_elems if fmt.block_elems == 256 else 9 * fmt.block_elems
    qweight, weight = _weight(fmt, N, k, seed=6)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(6))
    _assert_close(gguf_matmul.gguf_linear(x, qweight, fmt), F.linear(x, weight))


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.name)
def test_dequantize_is_exact(fmt: QuantFormat) -> None:
    k = 2 * fmt.block_elems if fmt.block_elems == 256 else 5 * fmt.block_elems
    qweight, weight = _weight(fmt, 21, k, seed=3)
    assert torch.equal(gguf_matmul.gguf_dequantize(qweight, fmt, k, torch.float32), weight)
    ids = torch.tensor([20, 0, 7, 7, 3])  # any order, repeats: embedding lookups
    rows = gguf_matmul.gguf_dequantize(qweight, fmt, k, torch.float32, ids)
    assert torch.equal(rows, weight[ids])
    # bfloat16: one rounding of the exact value (by truncation here, as noted above).
    as_bf16 = gguf_matmul.gguf_dequantize(qweight, fmt, k, torch.bfloat16, ids)
    torch.testing.assert_close(as_bf16, weight[ids].bfloat16(), atol=0, rtol=2**-7)


def test_backend_uses_the_kernels_and_falls_back() -> None:
    fmt = ALL_FORMATS[0]
    qweight, weight = _weight(fmt, 5, 64, seed=4)
    triton_backend, torch_backend = TritonBackend(), KernelBackend()
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(4))
    bias = torch.randn(5)
    _assert_close(triton_backend.quant_linear(x, qweight, fmt, bias), F.linear(x, weight, bias))
    # float64 has no kernel: the torch reference computes it.
    x64 = x.double()
    expected64 = torch_backend.quant_linear(x64, qweight, fmt, bias.double())
    assert torch.equal(triton_backend.quant_linear(x64, qweight, fmt, bias.double()), expected64)
    ids = torch.tensor([4, 1])
    embedded = triton_backend.quant_embedding(ids, qweight, fmt, 64, torch.float32)
    assert torch.equal(
        embedded, torch_backend.quant_embedding(ids, qweight, fmt, 64, torch.float32)
    )
    assert (
        triton_backend.quant_embedding(ids, qweight, fmt, 64, torch.float64).dtype == torch.float64
    )


def test_wrappers_reject_bad_inputs() -> None:
    fmt = ALL_FORMATS[0]
    qweight, _ = _weight(fmt, 5, 64, seed=5)
    x = torch.zeros(2, 64)
    with pytest.raises(ValueError, match="bytes"):
        gguf_matmul.gguf_linear(x[:, :32], qweight, fmt)  # K of 32 does not match the rows
    with pytest.raises(ValueError, match="bias"):
        gguf_matmul.gguf_linear(x, qweight, fmt, torch.zeros(5, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="int64"):
        gguf_matmul.gguf_dequantize(
            qweight, fmt, 64, torch.float32, torch.tensor([0], dtype=torch.int32)
        )
    empty = gguf_matmul.gguf_linear(torch.zeros(0, 64), qweight, fmt)
    assert empty.shape == (0, 5)
