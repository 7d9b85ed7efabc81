"""The kernel backend interface and its torch implementation.

The model code calls ``backend.linear``, ``backend.rms_norm``, ``backend.write_kv_cache``,
``backend.paged_attention`` and the rest of ``KernelBackend``'s methods, and never branches on
which backend it got. ``KernelBackend`` itself is the ``torch`` backend: every method in
readable torch (``reference.py``), the oracle the others are tested against and correct on any
device. The other backends subclass it and override only what they accelerate:

- ``cpu``: the C++ CPU ops (``cpu/backend.py``), the CPU default.
- ``triton``: Triton kernels (``triton_ops/backend.py``); on CUDA, or on CPU under
  ``TRITON_INTERPRET=1`` (tests).
- ``flash-attn``: flash-attn's varlen paged kernel for attention, Triton for the rest
  (``flash_attn.py``).

``backend_selection.select_kernel_backend`` chooses one (in a module of its own: the backends
import this interface, and the choice imports them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch

from corefleet.kernels import gguf_quant, reference
from corefleet.kernels.gguf_quant import QuantFormat
from corefleet.kernels.metadata import AttentionMetadata

Linear = Callable[[torch.Tensor], torch.Tensor]  # x [T, K] -> [T, N]
# KV caches stored in float8 (``--kv-cache-dtype fp8``), read by attention in the query's dtype.
FP8_KV_DTYPES = (torch.float8_e4m3fn,)
_FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448: e4m3fn has no infinity


def to_cache_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in the cache's dtype; into float8, saturated at its largest value (a plain cast
    would turn an outlier into NaN), with no scale (vLLM's default of 1.0)."""
    if dtype in FP8_KV_DTYPES:
        return t.clamp(-_FP8_MAX, _FP8_MAX).to(dtype)
    return t.to(dtype)


Norm = Callable[[torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]


class KernelBackend:
    """Every kernel the model and the sampler call, as readable torch: the ``torch`` backend.

    Subclasses override only the methods they accelerate, keeping each method's contract
    (shapes, dtypes, numerics within the tests' tolerances); inputs their kernels do not take
    they hand back to these implementations through ``super()``.
    """

    name: ClassVar[str] = "torch"
    # True: attention reads ``AttentionMetadata.block_tables``/``seq_lens``/``query_start_loc``
    # (the model runner builds them); False: the torch path's decode tables and prefill spans.
    needs_block_tables: ClassVar[bool] = False

    def linear(
        self,
        x: torch.Tensor,  # [T, K]
        weight: torch.Tensor,  # [N, K]
        bias: torch.Tensor | None,  # [N]
    ) -> torch.Tensor:  # [T, N]
        """``x @ weight.T + bias``: every linear layer's matmul, the LM head's included."""
        return torch.nn.functional.linear(x, weight, bias)

    def quant_linear(
        self,
        x: torch.Tensor,  # [T, K] float32 / bfloat16 / float16
        qweight: torch.Tensor,  # [N, K / block_elems * block_bytes] uint8, GGUF blocks
        fmt: QuantFormat,
        bias: torch.Tensor | None,  # [N], x's dtype
    ) -> torch.Tensor:  # [T, N], x's dtype
        """``x @ W.T + bias`` for a weight ``W`` kept in a GGUF block format (``gguf_quant``).

        The reference dequantizes the whole weight every call; kernels read the blocks and
        dequantize in registers.
        """
        weight = gguf_quant.dequantize(qweight, fmt, x.shape[1]).to(x.dtype)
        return torch.nn.functional.linear(x, weight, bias)

    def prepare_quant_weight(self, qweight: torch.Tensor, fmt: QuantFormat) -> None:
        """Called once by a quantized layer on its loaded blocks ``[N, row_bytes]``: a backend
        may rewrite them **in place** into a layout of its own, which its ``quant_linear`` and
        ``quant_embedding`` then read (the memory stays one copy). The default keeps the file's
        layout."""

    def restore_quant_weight(self, qweight: torch.Tensor, fmt: QuantFormat) -> None:
        """Undoes ``prepare_quant_weight`` in place (the file's layout again), before anything
        writes file blocks into the tensor. The default has nothing to undo."""

    # ---- kernels bound to one layer's weights ---------------------------------------------
    # A model binds each layer's weights once (engine/models/layer_program.py): a backend
    # decides then what it can (the kernel, the weight's dtype and layout) and a forward pass
    # calls the closures, without re-checking on every call. These defaults decide nothing.

    def bind_linear(self, weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
        """``x -> self.linear(x, weight, bias)`` (``weight`` [N, K], ``bias`` [N])."""
        return lambda x: self.linear(x, weight, bias)

    def bind_quant_linear(
        self, qweight: torch.Tensor, fmt: QuantFormat, bias: torch.Tensor | None, dtype: torch.dtype
    ) -> Linear:
        """``x -> self.quant_linear(x, qweight, fmt, bias)`` for activations of ``dtype``."""
        return lambda x: self.quant_linear(x, qweight, fmt, bias)

    def bind_rms_norm(self, weight: torch.Tensor, eps: float) -> Norm:
        """``(x, residual) -> self.rms_norm(x, weight, eps, residual)``."""
        return lambda x, residual: self.rms_norm(x, weight, eps, residual)

    def quant_embedding(
        self,
        ids: torch.Tensor,  # [T] int64, each in [0, V)
        qweight: torch.Tensor,  # [V, K / block_elems * block_bytes] uint8, GGUF blocks
        fmt: QuantFormat,
        k: int,
        dtype: torch.dtype,
    ) -> torch.Tensor:  # [T, K] dtype
        """The rows ``ids`` of a quantized embedding table, dequantized to ``dtype``."""
        return gguf_quant.dequantize(qweight.index_select(0, ids), fmt, k).to(dtype)

    def rms_norm(
        self,
        x: torch.Tensor,  # [T, H]
        weight: torch.Tensor,  # [H]
        eps: float,
        residual: torch.Tensor | None,  # [T, H]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # normed, new residual: [T, H]
        """RMSNorm of ``x + residual`` (or of ``x``); returns (normed, the new residual).

        Rounds where ``reference.rms_norm`` rounds (statistics in float32, the normed value
        cast to the dtype before the weight multiply, as Hugging Face's Llama).
        """
        return reference.rms_norm(x, weight, eps, residual)

    def apply_rotary(
        self,
        query: torch.Tensor,  # [T, Hq, D]
        key: torch.Tensor,  # [T, Hkv, D]
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,  # [T, 1, D]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # rotated query [T, Hq, D], key [T, Hkv, D]
        """GPT-NeoX "rotate half" rotary embedding of query and key by their positions' angles.

        A backend may rotate ``query`` and ``key`` in place (they are fresh projections) and
        return them: callers use the returned tensors and never the inputs again.
        """
        return reference.apply_rotary(query, key, cos, sin)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
        """SwiGLU on the fused gate/up projection: ``silu(x[:, :I]) * x[:, I:]``."""
        return reference.silu_and_mul(x)

    def fused_moe(
        self,
        x: torch.Tensor,  # [T, H]
        w13: torch.Tensor,  # [E, 2I, H] gate rows :I, up rows I:
        w2: torch.Tensor,  # [E, H, I]
        topk_weights: torch.Tensor,  # [T, K] float32
        topk_ids: torch.Tensor,  # [T, K] int32/int64; an id outside [0, E) is skipped
    ) -> torch.Tensor:  # [T, H], x's dtype
        """A mixture-of-experts layer's experts: each token's chosen SwiGLU experts, weighted
        and summed (``reference.fused_moe`` says it exactly)."""
        return reference.fused_moe(x, w13, w2, topk_weights, topk_ids)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:  # [B, V] -> [B] int64
        """Row-wise argmax with ``torch.argmax(dim=-1)``'s semantics (the first maximum; a
        row's first NaN wins): greedy sampling and the random draw both end in one."""
        return logits.argmax(dim=-1)

    def write_kv_cache(
        self,
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        slot_mapping: torch.Tensor,  # [T] int64: block * block_size + offset per token
    ) -> None:
        """Store each new token's K and V at its cache slot (before attention reads them)."""
        reference.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)

    def rotary_to_cache(
        self,
        qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) * D], the fused projection (rotated in place)
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,  # [T, 1, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        slot_mapping: torch.Tensor,  # [T] int64
        num_heads: int,
        num_kv_heads: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q [T, Hq, D], k, v [T, Hkv, D]
        """Attention's first half: split the fused projection into heads, rotate query and key
        (``apply_rotary``), bring all three to the cache's dtype (a 16-bit cache under float32
        activations: attention then runs in the cache's dtype; a float8 cache takes key and
        value only, the query keeps the activations' dtype) and store key and value at their
        slots (``write_kv_cache``). A backend may fuse it into one kernel."""
        num_tokens, head_dim = qkv.shape[0], k_cache.shape[-1]
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)  # views
        q = q.view(num_tokens, num_heads, head_dim)
        k = k.view(num_tokens, num_kv_heads, head_dim)
        v = v.view(num_tokens, num_kv_heads, head_dim)
        q, k = self.apply_rotary(q, k, cos, sin)
        if k_cache.dtype != qkv.dtype:
            k, v = to_cache_dtype(k, k_cache.dtype), to_cache_dtype(v, k_cache.dtype)
            # Attention runs in a 16-bit cache's dtype; a float8 cache is only storage.
            q = q if k_cache.dtype in FP8_KV_DTYPES else q.to(k_cache.dtype)
        self.write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
        return q, k, v

    def paged_attention(
        self,
        query: torch.Tensor,  # [T, Hq, D]
        key: torch.Tensor,  # [T, Hkv, D] the new tokens' keys (already in the cache too)
        value: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D]
        """Causal attention of every new token of the step (decode rows and prefill chunks)
        over its request's cached and new tokens, GQA included."""
        return reference.paged_attention(query, key, value, k_cache, v_cache, meta, scale)
