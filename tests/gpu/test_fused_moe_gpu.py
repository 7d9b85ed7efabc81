"""The fused-MoE Triton kernels natively on a GPU against the torch reference.

The routings of ``tests/moe_cases.py`` at a decode step's and a prefill's tile sizes (16- and
64-row blocks), on a layer of OLMoE's proportions scaled down, in every dtype the kernels take.
Run: ``pytest -q tests/gpu``.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.gpu_support import require_cuda

require_cuda()

from corefleet.kernels import reference  # noqa: E402  (only once a GPU is known to be here)
from corefleet.kernels.triton_ops.backend import TritonBackend  # noqa: E402
from tests.moe_cases import ROUTINGS, assert_close, moe_case  # noqa: E402

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("tokens", [1, 8, 512])
def test_triton_fused_moe(dtype: torch.dtype, routing: str, tokens: int) -> None:
    case = moe_case(tokens, 256, 136, 16, 4, dtype, routing, seed=tokens).to(CUDA)
    expected = reference.fused_moe(*case.args())
    assert_close(TritonBackend().fused_moe(*case.args()), expected)
