"""The torch reference of the integer GGUF linear (``csrc/gguf_vnni_cpu.cpp``): the same
activation quantization bit for bit, and the same per-block products, summed in float64.

The op computes ``x @ W.T`` with ``x`` rounded per block of 32 values to int8 with one float32
scale (llama.cpp's Q8_0 activations, scale in float32): ``d = max|x| / 127``,
``q = round_half_even(x * (1 / d))``. For each output and block, the integer dot of the weight's
stored integers with ``q`` is exact; it is scaled by ``d_w * d_x`` (float32) and the blocks are
summed. The tests compare the op with this, within float32 summation order; the difference
from the float path (``gguf_quant.dequantize`` + ``F.linear``) is the activations' rounding.
"""

from __future__ import annotations

import torch

from corefleet.kernels.gguf_quant import Q4_0, Q4_1, Q8_0, QuantFormat

PACKED_FORMATS = (Q4_0, Q4_1, Q8_0)  # the formats with a packed (VNNI) form
BLOCK = 32


def quantize_activations(
    x: torch.Tensor,  # [M, K] float32 or bfloat16, K % 32 == 0
) -> tuple[torch.Tensor, torch.Tensor]:  # q [M, K / 32, 32] int32 in [-127, 127], d [M, K/32]
    """Each block of 32 values to int8 and a float32 scale, as the op rounds them."""
    blocks = x.float().reshape(x.shape[0], -1, BLOCK)
    d = blocks.abs().amax(dim=-1) / 127.0  # float32 division, as the op's
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv.unsqueeze(-1))  # half to even, as vcvtps2dq
    return q.clamp(-127, 127).to(torch.int32), d


def _weight_parts(
    qweight: torch.Tensor, fmt: QuantFormat, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The stored integers [N, K/32, 32] (Q4_0 less its 8: the values' integer part), the scales
    d [N, K/32] and Q4_1's m [N, K/32] (else None), all from the file's blocks."""
    n = qweight.shape[0]
    blocks = qweight.reshape(n, k // BLOCK, fmt.block_bytes)

    def f16(offset: int) -> torch.Tensor:
        return blocks[:, :, offset : offset + 2].contiguous().view(torch.float16).float()[..., 0]

    if fmt == Q8_0:
        return blocks[:, :, 2:].contiguous().view(torch.int8).to(torch.int32), f16(0), None
    start = 2 if fmt == Q4_0 else 4
    nib = blocks[:, :, start:].to(torch.int32)
    q = torch.cat((nib & 0x0F, nib >> 4), dim=-1)  # byte j: values j and j + 16
    if fmt == Q4_0:
        return q - 8, f16(0), None
    return q, f16(0), f16(2)


def vnni_linear_reference(
    x: torch.Tensor,  # [M, K] float32 or bfloat16
    qweight: torch.Tensor,  # [N, K / 32 * block_bytes] uint8, file layout
    fmt: QuantFormat,
    bias: torch.Tensor | None,  # [N]
) -> tuple[torch.Tensor, torch.Tensor]:  # out [M, N] x's dtype, scale [M, N] float64
    """The op's result, and the sum of its terms' magnitudes per output (what a float32
    summation order can change it by, times a few ulps)."""
    if fmt not in PACKED_FORMATS:
        raise ValueError(f"{fmt.name} has no packed form")
    k = x.shape[1]
    q, d = quantize_activations(x)
    wq, dw, mw = _weight_parts(qweight, fmt, k)
    dots = torch.einsum("mbj,nbj->mnb", q.double(), wq.double()).float()  # exact integers
    scale = dw.unsqueeze(0) * d.unsqueeze(1)  # [M, N, nb] float32 product, as the op's
    terms = dots * scale
    if mw is not None:
        dsum = d * q.sum(dim=-1).float()  # [M, nb]
        terms = torch.cat((terms, mw.unsqueeze(0) * dsum.unsqueeze(1)), dim=-1)
    out = terms.double().sum(dim=-1)
    magnitude = terms.double().abs().sum(dim=-1)
    if bias is not None:
        out = out + bias.double()
        magnitude = magnitude + bias.double().abs()
    return out.to(x.dtype), magnitude
