"""GGUF block quantization: the formats corefleet keeps quantized, and their torch reference.

A quantized weight ``[N, K]`` (the ``nn.Linear`` layout: N outputs, K inputs) is kept exactly as
the GGUF file stores it: a ``uint8`` tensor ``[N, K // block_elems * block_bytes]``, each row the
row's blocks one after another. Every kernel (the C++ CPU ops, the Triton kernels, the torch
reference below) reads that layout, so loading is a copy of the file's bytes, no repacking.

The formats, per block (``d``, ``dmin``, ``m`` are float16; ``q`` the stored integers):

- ``Q8_0`` (32 values, 34 bytes): ``d``, 32 int8 ``q``; value = ``d * q``.
- ``Q4_0`` (32 values, 18 bytes): ``d``, 16 bytes of nibbles; byte ``j`` holds value ``j`` in
  its low nibble and value ``j + 16`` in its high one; value = ``d * (q - 8)``.
- ``Q4_1`` (32 values, 20 bytes): ``d``, ``m``, nibbles as Q4_0; value = ``d * q + m``.
- ``Q4_K`` (256 values, 144 bytes): ``d``, ``dmin``, 12 bytes packing eight 6-bit scales and
  eight 6-bit mins (one pair per sub-block of 32), then 128 bytes of nibbles: 32-byte group
  ``g`` holds sub-block ``2g`` in its low nibbles and ``2g + 1`` in its high ones;
  value = ``d * scale[s] * q - dmin * min[s]``.
- ``Q5_K`` (256 values, 176 bytes): as Q4_K with 32 bytes ``qh`` between the scales and the
  nibbles: bit ``s`` of ``qh[j]`` is the fifth bit of value ``j`` of sub-block ``s``.
- ``Q6_K`` (256 values, 210 bytes): 128 bytes low nibbles ``ql``, 64 bytes ``qh`` (2-bit high
  parts), 16 int8 scales (one per 16 values), ``d`` last; value = ``d * scale * (q - 32)``.
  Each half of 128 values uses 64 bytes of ``ql`` (low nibbles: values 0-63, high: 64-127)
  and 32 bytes of ``qh`` (bits ``2i..2i+1`` give values ``32i .. 32i + 31``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QuantFormat:
    """One GGUF block format: its name, ggml type id, values and bytes per block."""

    name: str
    ggml_type: int  # GGMLQuantizationType's value, as stored in the file
    block_elems: int
    block_bytes: int

    def row_bytes(self, k: int) -> int:
        """Bytes of one row of ``k`` values (``k`` a multiple of ``block_elems``)."""
        return k // self.block_elems * self.block_bytes


Q4_0 = QuantFormat("Q4_0", 2, 32, 18)
Q4_1 = QuantFormat("Q4_1", 3, 32, 20)
Q8_0 = QuantFormat("Q8_0", 8, 32, 34)
Q4_K = QuantFormat("Q4_K", 12, 256, 144)
Q5_K = QuantFormat("Q5_K", 13, 256, 176)
Q6_K = QuantFormat("Q6_K", 14, 256, 210)

FORMATS: dict[int, QuantFormat] = {f.ggml_type: f for f in (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K)}
FORMATS_BY_NAME: dict[str, QuantFormat] = {f.name: f for f in FORMATS.values()}


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:  # [nb, bytes] -> [nb, 1] fp32
    return blocks[:, offset : offset + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:  # [nb, G, B] -> [nb, G, 2, B] low, high
    return torch.stack((packed & 0x0F, packed >> 4), dim=2)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:  # [nb, 18] -> [nb, 32]
    q = _nibbles(blocks[:, 2:].unsqueeze(1)).reshape(-1, 32)
    return _f16(blocks, 0) * (q.float() - 8.0)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:  # [nb, 20] -> [nb, 32]
    q = _nibbles(blocks[:, 4:].unsqueeze(1)).reshape(-1, 32)
    return _f16(blocks, 0) * q.float() + _f16(blocks, 2)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:  # [nb, 34] -> [nb, 32]
    q = blocks[:, 2:].contiguous().view(torch.int8)
    return _f16(blocks, 0) * q.float()


def k_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 scale bytes ``[nb, 12]`` -> 6-bit scales and mins, each ``[nb, 8]``.

    Bytes 0-3 hold scales 0-3 in their low six bits, bytes 4-7 mins 0-3; scales and mins 4-7
    take their low four bits from bytes 8-11 (low and high nibble) and their top two bits
    from the top bits of bytes 0-3 and 4-7.
    """
    lo_s, lo_m, hi = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat((lo_s & 0x3F, (hi & 0x0F) | ((lo_s >> 2) & 0x30)), dim=1)
    mins = torch.cat((lo_m & 0x3F, (hi >> 4) | ((lo_m >> 2) & 0x30)), dim=1)
    return scales.float(), mins.float()


def _k_affine(blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:  # q [nb, 8, 32]
    scales, mins = k_scales_mins(blocks[:, 4:16])
    d = _f16(blocks, 0) * scales  # [nb, 8]
    dm = _f16(blocks, 2) * mins
    return (d.unsqueeze(-1) * q.float() - dm.unsqueeze(-1)).reshape(-1, 256)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:  # [nb, 144] -> [nb, 256]
    q = _nibbles(blocks[:, 16:].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    return _k_affine(blocks, q)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:  # [nb, 176] -> [nb, 256]
    low = _nibbles(blocks[:, 48:].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    shifts = torch.arange(8, dtype=torch.uint8).view(1, 8, 1)
    high = (blocks[:, 16:48].unsqueeze(1) >> shifts) & 1  # [nb, 8, 32]
    return _k_affine(blocks, low | (high << 4))


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:  # [nb, 210] -> [nb, 256]
    low = _nibbles(blocks[:, :128].reshape(-1, 2, 64)).reshape(-1, 2, 4, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    high = (blocks[:, 128:192].reshape(-1, 2, 1, 32) >> shifts) & 3  # [nb, 2, 4, 32]
    q = (low | (high << 4)).float() - 32.0
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()  # [nb, 16]
    d = (_f16(blocks, 208) * scales).view(-1, 16, 1)
    return (d * q.reshape(-1, 16, 16)).reshape(-1, 256)


_DEQUANTIZE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q8_0": _q8_0,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}


def dequantize(
    qweight: torch.Tensor,  # [N, K / block_elems * block_bytes] uint8
    fmt: QuantFormat,
    k: int,
) -> torch.Tensor:  # [N, K] float32
    """The readable reference: every block of every row to float32 values."""
    if qweight.dtype != torch.uint8 or qweight.dim() != 2:
        raise ValueError(f"a {fmt.name} weight is a 2-D uint8 tensor, got {qweight.dtype}")
    if k % fmt.block_elems or qweight.shape[1] != fmt.row_bytes(k):
        raise ValueError(
            f"a {fmt.name} row of {k} values has {fmt.row_bytes(k)} bytes "
            f"(k a multiple of {fmt.block_elems}), got {qweight.shape[1]}"
        )
    rows = qweight.shape[0]
    blocks = qweight.reshape(-1, fmt.block_bytes)
    return _DEQUANTIZE[fmt.name](blocks).reshape(rows, k)
