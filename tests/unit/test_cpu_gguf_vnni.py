"""The integer GGUF linear (``corefleet_cpu.gguf_linear_vnni`` on ``gguf_pack_vnni``'s packed
weights) against its torch reference (``kernels/gguf_vnni_reference.py``: the same activation
quantization, exact integer block dots), the packing's round trip, and its refusals."""

from __future__ import annotations

import pytest
import torch

from corefleet.kernels.gguf_quant import QuantFormat, dequantize
from corefleet.kernels.gguf_vnni_reference import (
    PACKED_FORMATS,
    quantize_activations,
    vnni_linear_reference,
)
from tests.cpu_ops_support import load_cpu_ops_or_skip
from tests.gguf_blocks import random_qweight

OPS = load_cpu_ops_or_skip()
DTYPES = [torch.float32, torch.bfloat16]
ROWS = [1, 2, 3, 4, 7, 8, 9, 17, 64, 65, 130]  # every pass width, chunks of 64 and a part
OUT_FEATURES = [1, 15, 16, 17, 100]  # a partial tile alone, one tile, tiles and a part
BLOCKS = [1, 2, 5, 33]


def packed_case(
    fmt: QuantFormat, n: int, blocks: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A random valid weight in the file's layout, its packed form, and K."""
    k = blocks * 32
    qweight = torch.from_numpy(random_qweight(fmt, n, k, seed=seed))
    return qweight, OPS.gguf_pack_vnni(qweight, fmt.ggml_type), k


def assert_matches_reference(
    out: torch.Tensor, x: torch.Tensor, qweight: torch.Tensor, fmt: QuantFormat, bias: object
) -> None:
    expected, magnitude = vnni_linear_reference(x, qweight, fmt, bias)  # type: ignore[arg-type]
    # float32 sums of the same products in another order: a few ulps of the terms' magnitude;
    # bfloat16 outputs: each side rounds its float32 sum once, so two sums a hair apart
    # across a rounding boundary are an ulp apart (2^-7 relative to the output).
    tol = 1e-5 * magnitude.float() + 1e-30
    if x.dtype == torch.bfloat16:
        tol = tol + expected.float().abs() * 2.0**-7
    err = (out.float() - expected.float()).abs()
    assert torch.all(err <= tol), f"max error {err.max():.3g} over tolerance (at {err.argmax()})"


@pytest.mark.parametrize("fmt", PACKED_FORMATS, ids=lambda f: f.name)
def test_pack_round_trip_and_size(fmt: QuantFormat) -> None:
    for n in OUT_FEATURES:
        qweight, packed, _k = packed_case(fmt, n, 3, seed=n)
        assert packed.shape == (-(-n // 16) * 16, qweight.shape[1])  # flat up to padding
        assert torch.equal(OPS.gguf_unpack_vnni(packed, fmt.ggml_type, n, None), qweight)
        rows = torch.tensor([n - 1, 0, n // 2, n - 1], dtype=torch.int64)
        assert torch.equal(OPS.gguf_unpack_vnni(packed, fmt.ggml_type, n, rows), qweight[rows])


@pytest.mark.parametrize("fmt", PACKED_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_matches_reference(fmt: QuantFormat, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(fmt.ggml_type)
    for n in OUT_FEATURES:
        for blocks in BLOCKS:
            qweight, packed, k = packed_case(fmt, n, blocks, seed=n * 100 + blocks)
            for m in ROWS if blocks <= 5 else ROWS[:4]:
                x = torch.randn(m, k, generator=gen).to(dtype)
                bias = torch.randn(n, generator=gen).to(dtype) if m % 2 else None
                out = OPS.gguf_linear_vnni(x, packed, fmt.ggml_type, n, bias)
                assert out.shape == (m, n) and out.dtype == dtype
                assert_matches_reference(out, x, qweight, fmt, bias)


@pytest.mark.parametrize("fmt", PACKED_FORMATS, ids=lambda f: f.name)
def test_threads_and_batch_rows_do_not_change_a_row(fmt: QuantFormat) -> None:
    """Each output is the same sum whatever the thread count and the other rows."""
    _qweight, packed, k = packed_case(fmt, 200, 8, seed=7)
    x = torch.randn(37, k)
    full = OPS.gguf_linear_vnni(x, packed, fmt.ggml_type, 200, None)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = OPS.gguf_linear_vnni(x, packed, fmt.ggml_type, 200, None)
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(full, single)
    for row in (0, 5, 36):
        alone = OPS.gguf_linear_vnni(x[row : row + 1], packed, fmt.ggml_type, 200, None)
        assert torch.equal(alone[0], full[row])


def test_activation_quantization_edges() -> None:
    """A zero block quantizes to zeros (scale 0), a block's largest value to +-127."""
    x = torch.zeros(2, 64)
    x[1, 32:] = torch.linspace(-3.0, 1.5, 32)
    q, d = quantize_activations(x)
    assert torch.all(q[0] == 0) and torch.all(q[1, 0] == 0) and d[1, 0] == 0
    assert q[1, 1].min() == -127 and d[1, 1] == pytest.approx(3.0 / 127)
    qweight, packed, _ = packed_case(PACKED_FORMATS[0], 16, 2, seed=3)
    out = OPS.gguf_linear_vnni(x, packed, PACKED_FORMATS[0].ggml_type, 16, None)
    assert torch.all(out[0] == 0)
    assert_matches_reference(out, x, qweight, PACKED_FORMATS[0], None)


@pytest.mark.parametrize("fmt", PACKED_FORMATS, ids=lambda f: f.name)
def test_close_to_the_float_path(fmt: QuantFormat) -> None:
    """The activations' rounding (half a step of max|block| / 127 a value) bounds the
    difference to the float product with the dequantized weights."""
    qweight, packed, k = packed_case(fmt, 64, 16, seed=11)
    x = torch.randn(5, k)
    out = OPS.gguf_linear_vnni(x, packed, fmt.ggml_type, 64, None)
    weight = dequantize(qweight, fmt, k)  # [N, K] float32
    exact = torch.nn.functional.linear(x.double(), weight.double())
    step = x.reshape(5, -1, 32).abs().amax(-1) / 127 / 2  # [M, nb] largest rounding error
    bound = torch.einsum("mb,nbj->mn", step.double(), weight.reshape(64, -1, 32).abs().double())
    assert torch.all((out.double() - exact).abs() <= bound * 1.001 + 1e-6)


def test_refusals_are_clear() -> None:
    fmt = PACKED_FORMATS[0]
    qweight, packed, k = packed_case(fmt, 20, 2, seed=1)
    t = fmt.ggml_type
    with pytest.raises(RuntimeError, match="no rows"):
        OPS.gguf_linear_vnni(torch.zeros(0, k), packed, t, 20, None)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        OPS.gguf_linear_vnni(torch.zeros(1, 48), packed, t, 20, None)
    with pytest.raises(RuntimeError, match=r"is \[32, 72\], got \[32, 36\]"):
        OPS.gguf_linear_vnni(torch.zeros(1, 2 * k), packed, t, 20, None)
    with pytest.raises(RuntimeError, match=r"N=33"):  # 48 packed rows, not 32
        OPS.gguf_linear_vnni(torch.zeros(1, k), packed, t, 33, None)
    with pytest.raises(RuntimeError, match="no packed form"):
        OPS.gguf_linear_vnni(torch.zeros(1, k), packed, 12, 20, None)
    with pytest.raises(RuntimeError, match="bias"):
        OPS.gguf_linear_vnni(torch.zeros(1, k), packed, t, 20, torch.zeros(19))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        OPS.gguf_linear_vnni(torch.zeros(1, k, dtype=torch.float16), packed, t, 20, None)
    with pytest.raises(RuntimeError, match="outside"):
        OPS.gguf_unpack_vnni(packed, t, 20, torch.tensor([20]))
    with pytest.raises(RuntimeError, match="positive multiple"):
        OPS.gguf_pack_vnni(qweight[:, :17].contiguous(), t)
