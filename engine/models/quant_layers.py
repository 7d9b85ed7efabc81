"""Layers whose weights stay in a GGUF block format (``corefleet.kernels.gguf_quant``).

A GGUF file stores q, k and v (and gate and up) as separate tensors, and a file may quantize
them differently (Q4_K_M files keep some v and down projections in Q6_K). A fused layer
therefore holds one block buffer per run of consecutive parts with the same format: parts of
one format are stacked row-wise and read by one kernel call, and a layer with several buffers
concatenates their outputs.

Once loaded, a layer hands each buffer to the backend once (``prepare_quant_weight``, on the
first forward or bind), which may rewrite it in place into a layout of its own (the CPU packs
Q4_0/Q4_1/Q8_0 for its integer linear); loading into a prepared layer restores the file's
layout first.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from corefleet.kernels.backend import KernelBackend, Linear
from corefleet.kernels.gguf_quant import QuantFormat


@dataclass(frozen=True)
class QuantPart:
    """One source tensor of a layer: its shard name (``q``, ``gate``, ... or None), rows and
    block format."""

    shard: str | None
    rows: int
    fmt: QuantFormat


@dataclass(frozen=True)
class _Buffer:
    name: str  # the registered buffer's attribute name
    fmt: QuantFormat
    row_start: int  # first output row (of the whole layer) this buffer computes
    rows: int


class QuantLinear(nn.Module):
    """A linear layer ``x @ W.T + b`` whose ``W`` stays in GGUF blocks, read by the backend's
    ``quant_linear``. The bias, if any, is a float parameter in the model's dtype."""

    def __init__(
        self, in_features: int, parts: list[QuantPart], bias: bool, backend: KernelBackend
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = sum(part.rows for part in parts)
        self.backend = backend
        buffers: list[_Buffer] = []
        self._located: dict[str | None, tuple[int, int, int]] = {}  # shard -> buffer, row, rows
        row = 0
        for part in parts:
            if not buffers or buffers[-1].fmt != part.fmt:
                buffers.append(_Buffer(f"qweight{len(buffers)}", part.fmt, row, 0))
            last = buffers[-1]
            self._located[part.shard] = (len(buffers) - 1, last.rows, part.rows)
            buffers[-1] = dataclasses.replace(last, rows=last.rows + part.rows)
            row += part.rows
        self._layout = tuple(buffers)
        for buf in buffers:
            blocks = torch.empty(buf.rows, buf.fmt.row_bytes(in_features), dtype=torch.uint8)
            self.register_buffer(buf.name, blocks)
        self._prepared = False  # the backend has seen the loaded buffers (_prepare)
        # Registered even when absent, so that forward finds it in _parameters either way.
        self.register_parameter(
            "bias", nn.Parameter(torch.zeros(self.out_features)) if bias else None
        )

    @property
    def formats(self) -> list[QuantFormat]:
        """The block format of each buffer, in output order."""
        return [buf.fmt for buf in self._layout]

    @property
    def shards(self) -> list[str | None]:
        """The parts' shard names, in output order."""
        return list(self._located)

    def part_blocks(self, shard: str | None) -> torch.Tensor:  # uint8 [rows, row_bytes]
        """The rows of the block buffer that hold part ``shard`` (a view, for loading)."""
        index, offset, rows = self._located[shard]
        if self._prepared:  # the file's layout back before the loader writes file blocks
            for buf in self._layout:
                self.backend.restore_quant_weight(self.get_buffer(buf.name), buf.fmt)
            self._prepared = False
        return self.get_buffer(self._layout[index].name).narrow(0, offset, rows)

    def share_blocks(self, blocks: torch.Tensor) -> None:
        """Use ``blocks`` (a tied embedding's table) as this single-buffer layer's weight."""
        (buf,) = self._layout
        setattr(self, buf.name, blocks)
        self._prepared = False

    def _apply(self, fn: Any, recurse: bool = True) -> QuantLinear:
        # Copies made by .to() and the like carry the bytes, not the backend's record of their
        # layout: the file's layout back first, prepared again on the next forward.
        if self._prepared:
            for buf in self._layout:
                self.backend.restore_quant_weight(self.get_buffer(buf.name), buf.fmt)
            self._prepared = False
        return super()._apply(fn, recurse)

    def _prepare(self) -> None:
        """The backend's one look at the loaded buffers (it may repack them in place)."""
        for buf in self._layout:
            self.backend.prepare_quant_weight(self.get_buffer(buf.name), buf.fmt)
        self._prepared = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        # Buffers and bias straight from the module's dicts: nn.Module.__getattr__ costs about a
        # microsecond a lookup, and a decode step of a 30-layer model runs 121 of these layers.
        if not self._prepared:
            self._prepare()
        blocks = cast(dict[str, torch.Tensor], self._buffers)  # every buffer is set at __init__
        bias = self._parameters["bias"]
        if len(self._layout) == 1:
            (buf,) = self._layout
            return self.backend.quant_linear(x, blocks[buf.name], buf.fmt, bias)
        outs = []
        for buf in self._layout:
            part_bias = None if bias is None else bias.narrow(0, buf.row_start, buf.rows)
            outs.append(self.backend.quant_linear(x, blocks[buf.name], buf.fmt, part_bias))
        return torch.cat(outs, dim=-1)

    def bind(self, dtype: torch.dtype) -> Linear:
        """``forward`` as a closure over the current blocks, for activations of ``dtype``."""
        if not self._prepared:
            self._prepare()
        blocks = cast(dict[str, torch.Tensor], self._buffers)
        bias = self._parameters["bias"]
        bound = [
            self.backend.bind_quant_linear(
                blocks[buf.name],
                buf.fmt,
                None if bias is None else bias.narrow(0, buf.row_start, buf.rows),
                dtype,
            )
            for buf in self._layout
        ]
        if len(bound) == 1:
            return bound[0]
        return lambda x: torch.cat([part(x) for part in bound], dim=-1)


class QuantEmbedding(nn.Module):
    """An embedding table kept in GGUF blocks; looked-up rows are dequantized to ``dtype``."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        fmt: QuantFormat,
        dtype: torch.dtype,
        backend: KernelBackend,
    ) -> None:
        super().__init__()
        self.embedding_dim = embedding_dim
        self.fmt = fmt
        self.dtype = dtype
        self.backend = backend
        self.register_buffer(
            "qweight",
            torch.empty(num_embeddings, fmt.row_bytes(embedding_dim), dtype=torch.uint8),
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, embedding_dim]
        table: torch.Tensor = self.qweight  # type: ignore[assignment]
        return self.backend.quant_embedding(ids, table, self.fmt, self.embedding_dim, self.dtype)
