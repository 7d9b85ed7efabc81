"""Residual add + RMSNorm in one Triton pass (``reference.rms_norm``'s contract).

Called by ``TritonBackend.rms_norm`` twice per decoder layer and once at the end. Unfused, the
add reads 2 rows and writes 1, the norm reads it back and the weight multiply reads and writes
it again; fused, each row is read once (x, residual) and written twice (normed, new residual).
Roundings follow the reference step by step (sum in the input dtype, statistics in float32,
normalised value cast back before the weight multiply), so float32 matches Hugging Face's
Llama up to summation order and bfloat16 within one rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from corefleet.kernels.triton_ops.support import (
    check_launchable,
    interpreter_tile,
    is_interpreted,
)

_INTERPRETER_ROWS = 128  # rows per program under the interpreter; one row per program on GPUs


def rms_norm(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]
) -> tuple[torch.Tensor, torch.Tensor]:  # normed, new residual: [T, H]
    """``weight * norm(x + residual)`` and ``x + residual`` (``x`` itself when no residual).

    Raises:
        ValueError: mismatched shapes, dtypes or devices, or a strided last dimension.
    """
    tensors = (x, weight) if residual is None else (x, weight, residual)
    check_launchable(_rms_norm_kernel, *tensors)
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} != x {tuple(x.shape)}")
    if any(t.dtype != x.dtype for t in tensors):
        raise ValueError(f"dtypes differ: {[t.dtype for t in tensors]}")
    if any(t.stride(-1) != 1 for t in tensors):
        raise ValueError("x, weight and residual need a contiguous last dimension")
    num_rows, hidden = x.shape
    out = torch.empty_like(x)  # [T, H]
    new_residual = x if residual is None else torch.empty_like(x)  # [T, H]
    if num_rows == 0:
        return out, new_residual
    block_rows = 1
    if is_interpreted(_rms_norm_kernel):
        block_rows = interpreter_tile(num_rows, _INTERPRETER_ROWS)
    block_h = triton.next_power_of_2(hidden)
    res = x if residual is None else residual  # unused pointer when there is no residual
    _rms_norm_kernel[(triton.cdiv(num_rows, block_rows),)](
        x,
        res,
        weight,
        out,
        new_residual,
        num_rows,
        hidden,
        x.stride(0),
        res.stride(0),
        out.stride(0),
        new_residual.stride(0),
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK_ROWS=block_rows,
        BLOCK_H=block_h,
        num_warps=min(16, max(1, block_h // 256)),  # ~8 elements per thread per row
    )
    return out, new_residual


@triton.jit
def _rms_norm_kernel(
    x_ptr: tl.tensor,  # [T, H]
    residual_ptr: tl.tensor,  # [T, H]; read only when HAS_RESIDUAL
    weight_ptr: tl.tensor,  # [H]
    out_ptr: tl.tensor,  # [T, H]
    new_residual_ptr: tl.tensor,  # [T, H]; written only when HAS_RESIDUAL
    num_rows: int,
    hidden: int,
    stride_x: int,
    stride_res: int,
    stride_out: int,
    stride_new_res: int,
    eps: float,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,  # hidden rounded up to a power of two: a whole row per tile
) -> None:
    rows = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)  # [ROWS]
    cols = tl.arange(0, BLOCK_H)  # [BLOCK_H]
    mask = (rows < num_rows)[:, None] & (cols < hidden)[None, :]  # [ROWS, BLOCK_H]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + rows[:, None] * stride_res + cols[None, :], mask=mask, other=0.0)
        # Rounded to the input dtype before the statistics, as the reference's x + residual.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(new_residual_ptr + rows[:, None] * stride_new_res + cols[None, :], x, mask=mask)
    xf = x.to(tl.float32)  # [ROWS, BLOCK_H]; padding columns are 0 and add nothing below
    inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / hidden + eps)  # [ROWS]
    normed = (xf * inv_rms[:, None]).to(x.dtype).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32)  # [BLOCK_H]
    out = (w[None, :] * normed).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], out, mask=mask)
