"""Triton and flash-attn kernels natively on a GPU against the torch reference.

The same matrix as ``tests/unit/triton`` (head sizes 64 and 128, GQA 1/3/4, block sizes 16 and
32, mixed batches with empty, partial and full blocks), plus float16, and flash-attn where it is
installed (its paged kernel takes blocks of 256 tokens); the GGUF matmul for every format at the
decode, middle and prefill tiles. Run: ``pytest -q tests/gpu``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.gpu.gpu_support import require_cuda

require_cuda()

from corefleet.kernels import reference  # noqa: E402  (only once a GPU is known to be here)
from corefleet.kernels.flash_attn import (  # noqa: E402
    FlashAttnBackend,
    flash_attn_installed,
)
from corefleet.kernels.gguf_quant import QuantFormat  # noqa: E402
from corefleet.kernels.triton_ops import activation as triton_activation  # noqa: E402
from corefleet.kernels.triton_ops import attention as triton_attention  # noqa: E402
from corefleet.kernels.triton_ops import gguf_matmul  # noqa: E402
from corefleet.kernels.triton_ops import rms_norm as triton_rms_norm  # noqa: E402
from corefleet.kernels.triton_ops import rotary as triton_rotary  # noqa: E402
from corefleet.kernels.triton_ops.backend import TritonBackend  # noqa: E402
from tests.gguf_blocks import ALL_FORMATS, oracle_dequantize, random_qweight  # noqa: E402
from tests.kernel_cases import (  # noqa: E402
    PagedBatch,
    assert_close,
    mixed_requests,
    paged_batch,
    poison_unused,
)

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _batch(
    block_size: int, num_kv_heads: int, group: int, head_dim: int, dtype: torch.dtype
) -> PagedBatch:
    requests = mixed_requests(block_size)
    return paged_batch(requests, block_size, num_kv_heads, group, head_dim, dtype).to(CUDA)


def _reference(batch: PagedBatch, scale: float) -> torch.Tensor:
    return reference.paged_attention(
        batch.query, batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta, scale
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("num_kv_heads", "group"), [(2, 1), (2, 3), (8, 4)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_triton_attention(
    dtype: torch.dtype, head_dim: int, num_kv_heads: int, group: int, block_size: int
) -> None:
    batch = _batch(block_size, num_kv_heads, group, head_dim, dtype)
    expected = _reference(batch, head_dim**-0.5)
    poison_unused(batch)
    actual = TritonBackend().paged_attention(
        batch.query,
        batch.key,
        batch.value,
        batch.k_cache,
        batch.v_cache,
        batch.meta,
        head_dim**-0.5,
    )
    assert not torch.isnan(actual).any()
    assert_close(actual, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("num_kv_heads", "group"), [(2, 1), (2, 3), (8, 4)])
def test_flash_attn(dtype: torch.dtype, num_kv_heads: int, group: int) -> None:
    if not flash_attn_installed():
        pytest.skip("flash_attn is not installed")
    batch = _batch(256, num_kv_heads, group, 128, dtype)  # flash-attn 2 pages: 256 tokens
    expected = _reference(batch, 128**-0.5)
    actual = FlashAttnBackend().paged_attention(
        batch.query,
        batch.key,
        batch.value,
        batch.k_cache,
        batch.v_cache,
        batch.meta,
        128**-0.5,
    )
    assert_close(actual, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_ops(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(37, 4096, generator=gen).to(dtype).to(CUDA)
    residual = torch.randn(37, 4096, generator=gen).to(dtype).to(CUDA)
    weight = (1 + 0.1 * torch.randn(4096, generator=gen)).to(dtype).to(CUDA)
    for res in (None, residual):
        normed, new_res = triton_rms_norm.rms_norm(x, weight, 1e-5, res)
        expected, expected_res = reference.rms_norm(x, weight, 1e-5, res)
        assert_close(normed, expected)
        assert torch.equal(new_res, expected_res)  # GPUs round float32 -> bf16 to nearest even
    qkv = torch.randn(37, 48 * 128, generator=gen).to(dtype).to(CUDA)
    q = qkv[:, : 32 * 128].view(37, 32, 128)
    k = qkv[:, 32 * 128 : 40 * 128].view(37, 8, 128)
    table = torch.randn(4096, 128, generator=gen).to(CUDA)
    cos, sin = reference.rotary_cos_sin(torch.arange(37, device=CUDA) * 97, table, dtype)
    expected_q, expected_k = reference.apply_rotary(q, k, cos, sin)
    actual_q, actual_k = triton_rotary.apply_rotary(q.clone(), k.clone(), cos, sin)
    assert_close(actual_q, expected_q)
    assert_close(actual_k, expected_k)
    gate_up = torch.randn(37, 2 * 14336, generator=gen).to(dtype).to(CUDA)
    assert_close(triton_activation.silu_and_mul(gate_up), reference.silu_and_mul(gate_up))


def test_decode_batch_of_8b_shape() -> None:
    # The benchmark's shape: 64 decode tokens, 32 query / 8 KV heads of 128, 1k contexts.
    requests = [(1023, 1)] * 64
    batch = paged_batch(requests, 16, 8, 4, 128, torch.bfloat16).to(CUDA)
    m = batch.meta
    assert m.block_tables is not None and m.seq_lens is not None
    assert m.query_start_loc is not None
    expected = _reference(batch, 128**-0.5)
    actual = triton_attention.unified_attention(
        batch.query,
        batch.k_cache,
        batch.v_cache,
        m.block_tables,
        m.seq_lens,
        m.query_start_loc,
        m.max_query_len,
        m.max_seq_len,
        128**-0.5,
    )
    assert_close(actual, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.name)
def test_gguf_linear(fmt: QuantFormat, dtype: torch.dtype) -> None:
    n, k = 1000, 2048  # 1000: a partial last column tile at every tile width
    raw = random_qweight(fmt, n, k, seed=8)
    weight = oracle_dequantize(raw, fmt).to(CUDA)  # [N, K] float32
    qweight = torch.from_numpy(raw).to(CUDA)
    rows = gguf_matmul.gguf_dequantize(qweight, fmt, k, torch.float32)
    assert torch.equal(rows, weight)
    ids = torch.tensor([999, 0, 5, 5], device=CUDA)
    assert torch.equal(
        gguf_matmul.gguf_dequantize(qweight, fmt, k, dtype, ids), weight[ids].to(dtype)
    )
    gen = torch.Generator().manual_seed(8)
    bias = torch.randn(n, generator=gen).to(dtype).to(CUDA)
    # Relative to the largest output: float32 summation order; bfloat16/float16 one rounding
    # of the output (W rounds to the dtype as in the reference, to nearest even).
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    for m in (1, 3, 16, 40, 300):  # decode, middle and prefill tiles
        x = torch.randn(m, k, generator=gen).to(dtype).to(CUDA)
        expected = F.linear(x, weight.to(dtype), bias)
        actual = gguf_matmul.gguf_linear(x, qweight, fmt, bias)
        assert actual.dtype == dtype and actual.shape == (m, n)
        atol = tol * expected.abs().max().item()
        torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=0)
