"""The C++ GGUF ops (``corefleet_cpu.gguf_linear``, ``gguf_dequantize``) against the ``gguf``
package's dequantization (tests/gguf_blocks.py: the oracle is never our code)."""

from __future__ import annotations

import pytest
import torch

from corefleet.kernels.backend import KernelBackend
from corefleet.kernels.cpu import backend as cpu_backend
from corefleet.kernels.gguf_quant import FORMATS_BY_NAME, QuantFormat
from tests.cpu_ops_support import load_cpu_ops_or_skip
from tests.gguf_blocks import ALL_FORMATS, oracle_dequantize, random_qweight

OPS = load_cpu_ops_or_skip()

DTYPES = [torch.float32, torch.bfloat16]
# float32: the dequantized weights' products summed in another order than torch's GEMM;
# bfloat16: outputs rounded once from float32 sums here and from torch's float32 result there,
# so they can differ by an ulp of the output.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 1e-2)}


def weights_for(x_dtype: torch.dtype, weight: torch.Tensor) -> list[torch.Tensor]:
    """The weights gguf_linear may multiply x by: the dequantized float32 values, and for
    bfloat16 x on a CPU with AVX512-BF16 (the vdpbf16ps path) those values rounded to
    bfloat16, as the reference backend rounds them."""
    if x_dtype == torch.bfloat16:
        return [weight, weight.bfloat16().float()]
    return [weight]


def assert_close_to_one(
    actual: torch.Tensor, expected: list[torch.Tensor], rtol: float, atol: float, what: str
) -> None:
    errors = []
    for candidate in expected:
        try:
            torch.testing.assert_close(actual.float(), candidate.float(), rtol=rtol, atol=atol)
            return
        except AssertionError as exc:
            errors.append(str(exc))
    raise AssertionError(f"{what}: " + "\n".join(errors))


# x rows: one pass in registers (1-3), decoded tiles with 3-row passes and their remainders,
# sub-bands side by side (<= 24) and adjacent tiles (more), beyond small_linear's 64.
ROWS = [1, 2, 3, 4, 5, 8, 17, 64, 65, 100]
OUT_FEATURES = [1, 7, 33, 100]  # a partial tile only; full tiles and a remainder


def block_counts(fmt: QuantFormat) -> list[int]:
    """K in blocks: one block up to several 512-value chunks (the decoded tile's) and a part."""
    return [1, 2, 3, 5, 16, 17, 33] if fmt.block_elems == 32 else [1, 2, 3, 5]


def case(
    fmt: QuantFormat, n: int, blocks: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A random valid weight: its blocks [n, row_bytes], the oracle's values [n, K], K."""
    k = blocks * fmt.block_elems
    raw = random_qweight(fmt, n, k, seed=seed)
    return torch.from_numpy(raw), oracle_dequantize(raw, fmt), k


def reference_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """F.linear in float64 on the oracle's weights, rounded to x's dtype."""
    b = None if bias is None else bias.double()
    return torch.nn.functional.linear(x.double(), weight.double(), b).to(x.dtype)


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_is_exact(fmt: QuantFormat, dtype: torch.dtype) -> None:
    for n in OUT_FEATURES:
        for blocks in block_counts(fmt):
            qweight, expected, k = case(fmt, n, blocks, seed=n * 10 + blocks)
            actual = OPS.gguf_dequantize(qweight, fmt.ggml_type, k, dtype)
            assert actual.shape == (n, k) and actual.dtype == dtype
            assert torch.equal(actual, expected.to(dtype)), (n, blocks)


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_the_dequantized_weights(
    fmt: QuantFormat, dtype: torch.dtype, with_bias: bool
) -> None:
    rtol, atol = TOLERANCE[dtype]
    for n in OUT_FEATURES:
        for blocks in block_counts(fmt):
            qweight, weight, k = case(fmt, n, blocks, seed=n * 10 + blocks)
            gen = torch.Generator().manual_seed(n + blocks)
            bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None  # [N]
            for rows in ROWS:
                x = torch.randn(rows, k, generator=gen).to(dtype)  # [M, K]
                actual = OPS.gguf_linear(x, qweight, fmt.ggml_type, bias)
                assert actual.shape == (rows, n) and actual.dtype == dtype
                expected = [reference_linear(x, w, bias) for w in weights_for(dtype, weight)]
                assert_close_to_one(actual, expected, rtol, atol, f"N={n} K={k} M={rows}")


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_does_not_depend_on_the_rest_of_the_batch(
    fmt: QuantFormat, dtype: torch.dtype
) -> None:
    """Each output is summed in the same order whichever path (registers, decoded tile) and
    tile shape the batch size picks: a request's logits are the same in any batch."""
    blocks = 20 if fmt.block_elems == 32 else 3  # K = 640 or 768: a chunk and a part
    qweight, _, k = case(fmt, 131, blocks, seed=5)  # [131, .]: uneven sub-bands, remainder
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(1)).to(dtype)  # [M, K]
    batch = OPS.gguf_linear(x, qweight, fmt.ggml_type, None)
    for rows in (1, 2, 3, 4, 5, 30):
        assert torch.equal(OPS.gguf_linear(x[:rows], qweight, fmt.ggml_type, None), batch[:rows])


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("rows", [1, 5, 37])  # in registers; sub-bands; adjacent tiles
def test_result_does_not_depend_on_thread_count(fmt: QuantFormat, rows: int) -> None:
    qweight, _, k = case(fmt, 1003, 512 // fmt.block_elems, seed=2)  # [1003, .]: uneven bands
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(3))  # [M, K]
    bias = torch.randn(1003, generator=torch.Generator().manual_seed(4))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = OPS.gguf_linear(x, qweight, fmt.ggml_type, bias)
        dequantized = OPS.gguf_dequantize(qweight, fmt.ggml_type, k, torch.float32)
        for threads in (2, 3):
            torch.set_num_threads(threads)
            assert torch.equal(OPS.gguf_linear(x, qweight, fmt.ggml_type, bias), single)
            assert torch.equal(
                OPS.gguf_dequantize(qweight, fmt.ggml_type, k, torch.float32), dequantized
            )
    finally:
        torch.set_num_threads(before)


Q4_K = FORMATS_BY_NAME["Q4_K"]
Q8_0 = FORMATS_BY_NAME["Q8_0"]
_Q8_W = torch.from_numpy(random_qweight(Q8_0, 4, 64))  # [4, 68]: K = 64
_Q4K_W = torch.from_numpy(random_qweight(Q4_K, 4, 256))  # [4, 144]: K = 256


@pytest.mark.parametrize(
    ("x", "qweight", "ggml_type", "bias", "message"),
    [
        (torch.randn(2, 64).double(), _Q8_W, 8, None, "float32 or bfloat16"),
        (torch.randn(2, 64).half(), _Q8_W, 8, None, "float32 or bfloat16"),
        (torch.randn(64, 2).t(), _Q8_W, 8, None, "x must be contiguous"),
        (torch.randn(64), _Q8_W, 8, None, r"x must be \[M, K\]"),
        (torch.randn(2, 64), _Q8_W.view(torch.int8), 8, None, "2-D uint8"),
        (torch.randn(2, 64), _Q8_W.flatten(), 8, None, "2-D uint8"),
        (torch.randn(2, 64), _Q8_W[:, :34].contiguous(), 8, None, "has 68 bytes"),
        (torch.randn(2, 64), _Q8_W.t().contiguous().t(), 8, None, "qweight must be contiguous"),
        (torch.randn(2, 64), _Q8_W, 6, None, "unsupported ggml_type 6"),  # Q5_0
        (torch.randn(2, 64), _Q8_W, 0, None, "unsupported ggml_type 0"),  # F32
        (torch.randn(2, 128), _Q4K_W, 12, None, "multiple of Q4_K's block of 256"),
        (torch.randn(2, 64), _Q8_W, 8, torch.randn(3), r"bias must be a contiguous \[N\]"),
        (torch.randn(2, 64), _Q8_W, 8, torch.randn(4).bfloat16(), "of x's dtype"),
    ],
)
def test_linear_rejects_bad_arguments(
    x: torch.Tensor,
    qweight: torch.Tensor,
    ggml_type: int,
    bias: torch.Tensor | None,
    message: str,
) -> None:
    with pytest.raises(RuntimeError, match=message):
        OPS.gguf_linear(x, qweight, ggml_type, bias)


@pytest.mark.parametrize(
    ("qweight", "ggml_type", "k", "dtype", "message"),
    [
        (_Q8_W, 8, 64, torch.float16, "float32 or bfloat16"),
        (_Q8_W, 8, 32, torch.float32, "has 34 bytes"),
        (_Q8_W, 8, 48, torch.float32, "multiple of Q8_0's block of 32"),
        (_Q8_W, 8, 0, torch.float32, "positive multiple"),
        (_Q8_W, 99, 64, torch.float32, "unsupported ggml_type 99"),
        (_Q8_W.view(torch.int8), 8, 64, torch.float32, "2-D uint8"),
    ],
)
def test_dequantize_rejects_bad_arguments(
    qweight: torch.Tensor, ggml_type: int, k: int, dtype: torch.dtype, message: str
) -> None:
    with pytest.raises(RuntimeError, match=message):
        OPS.gguf_dequantize(qweight, ggml_type, k, dtype)


def test_empty_batch_and_weight() -> None:
    qweight, _, k = case(Q8_0, 5, 2)
    assert OPS.gguf_linear(torch.empty(0, k), qweight, 8, None).shape == (0, 5)
    assert OPS.gguf_linear(torch.randn(3, k), qweight[:0], 8, None).shape == (3, 0)
    assert OPS.gguf_dequantize(qweight[:0], 8, k, torch.bfloat16).shape == (0, k)


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", [*DTYPES, torch.float16])  # float16: the torch reference
@pytest.mark.parametrize("rows", [1, 4, "threshold", "above"])
def test_backend_quant_linear(fmt: QuantFormat, dtype: torch.dtype, rows: int | str) -> None:
    """The backend's dispatch (the op for a few rows, dequantize + torch's GEMM above, the
    reference for what the ops do not take) gives the reference backend's answer."""
    if isinstance(rows, str):
        threshold = cpu_backend.GGUF_LINEAR_MAX_ROWS.get(dtype, 64)
        rows = threshold if rows == "threshold" else threshold + 1
    qweight, _, k = case(fmt, 40, 2, seed=rows)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen).to(dtype)  # [T, K]
    bias = torch.randn(40, generator=gen).to(dtype)  # [N]
    expected = KernelBackend().quant_linear(x, qweight, fmt, bias)
    actual = cpu_backend.CpuBackend().quant_linear(x, qweight, fmt, bias)
    assert actual.dtype == dtype and actual.shape == (rows, 40)
    rtol, atol = TOLERANCE.get(dtype, (1e-2, 1e-2))
    if dtype == torch.bfloat16:  # the reference rounds the weights to bf16; the op does not
        rtol, atol = 2e-2, 5e-2
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", [*DTYPES, torch.float16])
def test_backend_quant_embedding(fmt: QuantFormat, dtype: torch.dtype) -> None:
    qweight, _, k = case(fmt, 50, 2, seed=9)
    ids = torch.tensor([3, 0, 49, 3, 17])
    expected = KernelBackend().quant_embedding(ids, qweight, fmt, k, dtype)
    actual = cpu_backend.CpuBackend().quant_embedding(ids, qweight, fmt, k, dtype)
    assert actual.dtype == dtype
    assert torch.equal(actual, expected)
