"""Random GGUF-quantized weights for kernel and loader tests, with their oracle.

``random_qweight`` fills every byte at random and then overwrites the float16 fields (scales,
mins) with moderate values, so blocks are valid and dequantize to finite numbers of the size a
real checkpoint has; every nibble, high bit and 6-bit scale pattern occurs. The oracle is the
``gguf`` package's own dequantization (llama.cpp's Python reference), never our code.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch
from gguf.quants import dequantize as gguf_dequantize

from corefleet.kernels.gguf_quant import FORMATS, QuantFormat

ALL_FORMATS: tuple[QuantFormat, ...] = tuple(FORMATS.values())

# Byte offsets of each format's float16 fields within a block.
_F16_OFFSETS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q8_0": (0,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}


def random_qweight(
    fmt: QuantFormat, n: int, k: int, seed: int = 0, scale: float = 0.02
) -> np.ndarray:
    """A ``[n, fmt.row_bytes(k)]`` uint8 array of valid ``fmt`` blocks (``k`` a block multiple)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, fmt.row_bytes(k)), dtype=np.uint8)
    blocks = raw.reshape(-1, fmt.block_bytes)
    # K-quants multiply d by a 6-bit scale (up to 63) and Q6_K's by an int8 (up to 128).
    per_unit = {"Q4_K": 1 / 40, "Q5_K": 1 / 80, "Q6_K": 1 / 2000}.get(fmt.name, 1 / 8)
    for offset in _F16_OFFSETS[fmt.name]:
        values = rng.uniform(-scale, scale, size=(blocks.shape[0], 1)) * per_unit
        blocks[:, offset : offset + 2] = values.astype(np.float16).view(np.uint8)
    return raw


def oracle_dequantize(raw: np.ndarray, fmt: QuantFormat) -> torch.Tensor:
    """``[n, k]`` float32 values of ``raw`` by the ``gguf`` package's dequantization."""
    values = gguf_dequantize(raw, gguf.GGMLQuantizationType(fmt.ggml_type))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
