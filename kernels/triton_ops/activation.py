"""SiLU-and-mul (SwiGLU's activation) in Triton (``reference.silu_and_mul``).

Called by ``TritonBackend.silu_and_mul`` once per MLP on the fused gate|up projection: one pass
reads both halves and writes the product, where torch would write silu(gate) and read it back.
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

_GPU_TOKENS = 1
_GPU_COLS = 1024
_INTERPRETER_TOKENS = 128


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """``silu(gate) * up`` for ``x = gate | up`` along the last dimension.

    Raises:
        ValueError: an odd last dimension, a strided last dimension, or a device Triton cannot
            launch on.
    """
    check_launchable(_silu_and_mul_kernel, x)
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, 2I] with a contiguous last dimension, got {x.shape}")
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_tokens, inter), dtype=x.dtype, device=x.device)  # [T, I]
    if num_tokens == 0:
        return out
    if is_interpreted(_silu_and_mul_kernel):
        block_t = interpreter_tile(num_tokens, _INTERPRETER_TOKENS)
        block_i = triton.next_power_of_2(inter)
    else:
        block_t, block_i = _GPU_TOKENS, min(_GPU_COLS, triton.next_power_of_2(inter))
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(inter, block_i))
    _silu_and_mul_kernel[grid](
        x, out, num_tokens, inter, x.stride(0), out.stride(0), BLOCK_T=block_t, BLOCK_I=block_i
    )
    return out


@triton.jit
def _silu_and_mul_kernel(
    x_ptr: tl.tensor,  # [T, 2I]: gate in [:, :I], up in [:, I:]
    out_ptr: tl.tensor,  # [T, I]
    num_tokens: int,
    inter: int,  # I
    stride_x: int,
    stride_out: int,
    BLOCK_T: tl.constexpr,
    BLOCK_I: tl.constexpr,
) -> None:
    tok = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)  # [BLOCK_T]
    col = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)  # [BLOCK_I]
    mask = (tok < num_tokens)[:, None] & (col < inter)[None, :]  # [BLOCK_T, BLOCK_I]
    gate_ptr = x_ptr + tok[:, None] * stride_x + col[None, :]
    gate = tl.load(gate_ptr, mask=mask, other=0.0)
    up = tl.load(gate_ptr + inter, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # silu(gate) rounded to the input dtype before the product, as the reference's two ops.
    act = (g * tl.sigmoid(g)).to(gate.dtype).to(tl.float32)
    out = (act * up.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + tok[:, None] * stride_out + col[None, :], out, mask=mask)
