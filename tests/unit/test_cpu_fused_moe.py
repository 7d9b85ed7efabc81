"""The C++ fused mixture-of-experts op against the torch reference, and the reference against a
dense token-by-token computation.

The op takes each expert through one of two paths by its row count (the streaming tiles below
``gemm_min_rows``, torch's GEMM from it): the cases run with every expert streamed, every
expert on the GEMM, and the backend's own threshold.
"""

from __future__ import annotations

import pytest
import torch

from corefleet.kernels import reference
from corefleet.kernels.cpu import backend as cpu_backend
from tests.cpu_ops_support import load_cpu_ops_or_skip
from tests.moe_cases import ROUTINGS, assert_close, dense_moe, moe_case

OPS = load_cpu_ops_or_skip()
BACKEND = cpu_backend.CpuBackend()

DTYPES = [torch.float32, torch.bfloat16]
STREAM_ALL, GEMM_ALL = 257, 1  # gemm_min_rows: the op's largest (every expert streamed), least
# (T, H, I, E, K): decode-sized, odd sizes (H and I not multiples of 16), a prefill-sized
# batch with experts of tens of rows.
Shape = tuple[int, int, int, int, int]
SHAPES: list[Shape] = [(1, 64, 32, 8, 2), (7, 40, 24, 5, 2), (9, 130, 70, 6, 3), (96, 48, 40, 4, 2)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-H{}-I{}-E{}-K{}".format(*s))
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("gemm_min_rows", [STREAM_ALL, GEMM_ALL, 4])
def test_op_matches_reference(
    dtype: torch.dtype, shape: Shape, routing: str, gemm_min_rows: int
) -> None:
    case = moe_case(*shape, dtype, routing, seed=sum(shape))
    expected = reference.fused_moe(*case.args())
    actual = OPS.fused_moe(*case.args(), gemm_min_rows)
    assert_close(actual, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("top_k", [1, 2])
def test_all_tokens_on_one_expert(dtype: torch.dtype, top_k: int) -> None:
    # 70 rows on one expert: many 3-row passes of a streamed tile, and the GEMM path from 64.
    case = moe_case(70, 48, 40, 4, top_k, dtype, "one_expert", seed=top_k)
    expected = reference.fused_moe(*case.args())
    for gemm_min_rows in (STREAM_ALL, GEMM_ALL, 64):
        assert_close(OPS.fused_moe(*case.args(), gemm_min_rows), expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [0, 1])
def test_backend_tiny_batches(dtype: torch.dtype, tokens: int) -> None:
    case = moe_case(tokens, 64, 32, 8, 2, dtype, seed=tokens)
    actual = BACKEND.fused_moe(*case.args())
    assert_close(actual, reference.fused_moe(*case.args()))


@pytest.mark.parametrize("dtype", DTYPES)
def test_backend_int32_ids_and_strided_x(dtype: torch.dtype) -> None:
    case = moe_case(12, 48, 40, 6, 2, dtype, "skipped", seed=3, ids_dtype=torch.int32)
    wide = torch.cat([case.x, case.x], dim=1)  # [T, 2H]
    x = wide[:, : case.x.shape[1]]  # [T, H] rows 2H apart, as a slice of a fused projection
    assert not x.is_contiguous()
    actual = BACKEND.fused_moe(x, case.w13, case.w2, case.topk_weights, case.topk_ids)
    assert_close(actual, reference.fused_moe(*case.args()))


def test_backend_hands_float16_to_the_reference() -> None:
    case = moe_case(5, 48, 40, 4, 2, torch.float16, "skipped", seed=4)
    assert torch.equal(BACKEND.fused_moe(*case.args()), reference.fused_moe(*case.args()))


def test_no_expert_gives_zeros() -> None:
    case = moe_case(6, 32, 16, 4, 2, torch.bfloat16, "none")
    out = OPS.fused_moe(*case.args(), STREAM_ALL)
    assert out.dtype == torch.bfloat16 and torch.equal(out, torch.zeros_like(case.x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_streamed_path_does_not_depend_on_threads(dtype: torch.dtype) -> None:
    # Each output is one task's fixed-order sum and each token's combine adds its experts in
    # ascending order: the same bits on one thread as on two (no race, no atomics).
    case = moe_case(40, 96, 72, 8, 3, dtype, "repeated", seed=5)
    threads = torch.get_num_threads()
    two = OPS.fused_moe(*case.args(), STREAM_ALL)
    try:
        torch.set_num_threads(1)
        one = OPS.fused_moe(*case.args(), STREAM_ALL)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_op_refuses_what_it_does_not_take() -> None:
    case = moe_case(3, 32, 16, 4, 2, torch.float32)
    with pytest.raises(RuntimeError, match="weights must have x's dtype"):
        OPS.fused_moe(case.x, case.w13.bfloat16(), case.w2, case.topk_weights, case.topk_ids, 4)
    with pytest.raises(RuntimeError, match="shapes disagree"):
        OPS.fused_moe(case.x, case.w13, case.w2[:, :-1].contiguous(), *case.args()[3:], 4)
    with pytest.raises(RuntimeError, match="gemm_min_rows"):
        OPS.fused_moe(*case.args(), 0)


@pytest.mark.parametrize("routing", ["topk", "skipped", "repeated"])
@pytest.mark.parametrize(
    # float64 inputs: the reference's combine is float32 all the same (its contract).
    ("dtype", "tolerance"),
    [(torch.float64, 1e-6), (torch.float32, 2e-5), (torch.bfloat16, 5e-2)],
)
def test_reference_matches_dense_token_loop(
    routing: str, dtype: torch.dtype, tolerance: float
) -> None:
    case = moe_case(11, 40, 24, 6, 3, dtype, routing, seed=6)
    actual = reference.fused_moe(*case.args())
    assert actual.dtype == dtype
    expected = dense_moe(case)
    torch.testing.assert_close(actual.double(), expected, rtol=tolerance, atol=tolerance)
