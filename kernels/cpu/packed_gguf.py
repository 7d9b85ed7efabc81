"""GGUF weights repacked in place for the CPU's integer linear (``csrc/gguf_vnni_cpu.cpp``).

A Q4_0, Q4_1 or Q8_0 weight whose rows are a multiple of 16 is rewritten once, in its own
tensor, into tiles of 16 interleaved rows (``csrc/gguf_vnni_layout.h``: the same bytes, so the
memory stays one copy) and from then on multiplied by ``gguf_linear_vnni``: activations
quantized per block of 32 to int8, integer dot products (AVX512-VNNI ``vpdpbusd``), float32
sums per block. Which tensors hold the packed layout is recorded here by the tensor's identity,
so that every reader of a shared tensor (a tied embedding and its LM head) sees it: embedding
lookups unpack their rows.

Only with ``COREFLEET_GGUF_PACKED=1`` (``kernels/envs.py``: off by default for now, because
quantized activations move SmolLM2's greedy tokens) and where the loaded build runs the op on
VNNI (``gguf_vnni_available``); elsewhere weights keep the file's layout and the float paths.
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

from corefleet.kernels import envs
from corefleet.kernels.gguf_quant import QuantFormat

PACKED_TYPES = frozenset({2, 3, 8})  # Q4_0, Q4_1, Q8_0
TILE_ROWS = 16

_PACKED: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> its QuantFormat


def enabled(ops: torch._ops._OpNamespace) -> bool:
    """Whether weights are packed in this process: asked for, and the op runs on VNNI."""
    return envs.gguf_packed() and bool(ops.gguf_vnni_available())


def is_packed(qweight: torch.Tensor) -> bool:
    return qweight in _PACKED


def pack_in_place(ops: torch._ops._OpNamespace, qweight: torch.Tensor, fmt: QuantFormat) -> None:
    """Rewrites ``qweight`` [N, row_bytes] into the packed layout if it has one (N % 16 == 0;
    otherwise it keeps the file's layout); a packed tensor is left as it is."""
    if (
        qweight in _PACKED
        or fmt.ggml_type not in PACKED_TYPES
        or qweight.dtype != torch.uint8
        or qweight.dim() != 2
        or not qweight.is_contiguous()
        or qweight.shape[0] == 0
        or qweight.shape[0] % TILE_ROWS
        or qweight.device.type != "cpu"
    ):
        return
    qweight.copy_(ops.gguf_pack_vnni(qweight, fmt.ggml_type))  # a transient copy of one layer
    _PACKED[qweight] = fmt


def unpack_in_place(ops: torch._ops._OpNamespace, qweight: torch.Tensor) -> None:
    """The file's layout back in ``qweight``, if it is packed."""
    fmt = _PACKED.pop(qweight, None)
    if fmt is not None:
        qweight.copy_(ops.gguf_unpack_vnni(qweight, fmt.ggml_type, qweight.shape[0], None))


def packed_linear(
    ops: torch._ops._OpNamespace,
    x: torch.Tensor,  # [T, K]
    qweight: torch.Tensor,  # [N, row_bytes] packed
    fmt: QuantFormat,
    bias: torch.Tensor | None,  # [N]
) -> torch.Tensor:  # [T, N], x's dtype
    """``x @ W.T + bias`` on a packed weight; other activation dtypes (float16) in float32."""
    n = qweight.shape[0]
    if x.shape[0] == 0:
        return x.new_empty((0, n))
    dtype = x.dtype if x.dtype in (torch.float32, torch.bfloat16) else torch.float32
    b = None if bias is None else bias.to(dtype).contiguous()
    out: torch.Tensor = ops.gguf_linear_vnni(x.to(dtype).contiguous(), qweight, fmt.ggml_type, n, b)
    return out.to(x.dtype)


def file_rows(
    ops: torch._ops._OpNamespace,
    qweight: torch.Tensor,  # [N, row_bytes] packed
    ids: torch.Tensor,  # [T] int64
) -> torch.Tensor:  # [T, row_bytes] in the file's layout
    """Rows of a packed table as the file stores them (an embedding lookup)."""
    fmt = _PACKED[qweight]
    rows: torch.Tensor = ops.gguf_unpack_vnni(
        qweight, fmt.ggml_type, qweight.shape[0], ids.to(torch.int64).contiguous()
    )
    return rows
