"""The building blocks of a decoder layer: RMSNorm, a linear layer whose matmul is the kernel
backend's, and the factory that builds each linear layer dense or GGUF-quantized."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from corefleet.engine.models.quant_layers import QuantLinear, QuantPart
from corefleet.kernels.backend import KernelBackend, Linear, Norm
from corefleet.kernels.gguf_quant import QuantFormat


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, backend: KernelBackend) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.backend = backend

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        residual: torch.Tensor | None = None,  # [T, H]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # normed, new residual
        return self.backend.rms_norm(x, self.weight, self.eps, residual)

    def bind(self) -> Norm:
        """``forward`` as a closure over the weight (``layer_program``)."""
        return self.backend.bind_rms_norm(self.weight, self.eps)


class BackendLinear(nn.Linear):
    """``nn.Linear`` (same parameters and names) whose matmul is the kernel backend's."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, backend: KernelBackend
    ) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        return self.backend.linear(x, self.weight, self.bias)

    def bind(self, dtype: torch.dtype) -> Linear:
        """``forward`` as a closure over the weight (``layer_program``); ``dtype`` is unused:
        the weight's own dtype decides."""
        return self.backend.bind_linear(self.weight, self.bias)


class LinearFactory:
    """Builds each linear layer dense or quantized, by the formats of its source tensors."""

    def __init__(self, backend: KernelBackend, quantized: Mapping[str, QuantFormat]) -> None:
        self.backend = backend
        self.quantized = quantized

    def __call__(
        self,
        in_features: int,
        parts: list[tuple[str, str | None, int]],  # (HF name, shard, rows) in output order
        bias: bool,
    ) -> BackendLinear | QuantLinear:
        formats = [self.quantized.get(hf_name) for hf_name, _, _ in parts]
        if all(fmt is not None for fmt in formats):
            quant_parts = [
                QuantPart(shard, rows, fmt)
                for (_, shard, rows), fmt in zip(parts, formats, strict=True)
                if fmt is not None
            ]
            return QuantLinear(in_features, quant_parts, bias, self.backend)
        out_features = sum(rows for _, _, rows in parts)
        return BackendLinear(in_features, out_features, bias, self.backend)
