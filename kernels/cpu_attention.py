"""CPU paged attention: a C++ decode kernel that reads K/V in place from the paged cache.

The torch reference gathers every decode row's blocks into a padded copy and runs SDPA over
it, which moves several times the bytes the attention needs. The C++ op in
``csrc/paged_attention_cpu.cpp`` walks each row's block table instead and reads only the
positions below the row's context length. Prefill spans (several new tokens) stay on the
reference path.

The op is compiled at first use with ``torch.utils.cpp_extension`` (ninja + a C++ compiler
are needed) and cached twice: once per process here, and across processes by torch in
``~/.cache/torch_extensions`` (torch serialises concurrent builds with a file lock).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import platform
import threading
import time
from pathlib import Path

import torch

from corefleet.kernels import reference
from corefleet.kernels.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"
# -march=native: the kernel relies on auto-vectorisation (AVX2/AVX-512 where present).
# -fopenmp: at::parallel_for is a header template; without OpenMP it silently runs serially.
# The extension links libgomp.so.1 by soname, so it shares the pool torch already loaded.
_CFLAGS = ["-O3", "-march=native", "-fopenmp"]
_LDFLAGS = ["-fopenmp"]

_op_lock = threading.Lock()
_op: torch._ops.OpOverloadPacket | None = None


def _extension_name() -> str:
    """Build name keyed by the CPU's feature flags.

    ``-march=native`` code must not be reused on a CPU with fewer features (for example a
    home directory shared between machines), and torch's build cache is keyed by name.
    """
    flags = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line
                break
    except OSError:
        pass
    return "corefleet_paged_attention_cpu_" + hashlib.sha1(flags.encode()).hexdigest()[:10]


def load_cpu_attention_op() -> torch._ops.OpOverloadPacket:
    """Compile (or reuse) the C++ op and return ``torch.ops.corefleet_cpu.paged_decode_attention``.

    Raises whatever the build raises (no ninja, no compiler, compile error); callers decide
    whether to fall back.
    """
    global _op
    with _op_lock:
        if _op is None:
            # Imported lazily: cpp_extension pulls in setuptools, which engines that never use
            # this backend should not pay for.
            from torch.utils.cpp_extension import load

            started = time.perf_counter()
            load(
                name=_extension_name(),
                sources=[str(_SOURCE)],
                extra_cflags=_CFLAGS,
                extra_ldflags=_LDFLAGS,
                is_python_module=False,  # registers the op through TORCH_LIBRARY
                verbose=False,
            )
            _op = torch.ops.corefleet_cpu.paged_decode_attention
            logger.info("CPU paged attention op ready in %.1f s", time.perf_counter() - started)
        return _op


def decode_attention(
    query: torch.Tensor,  # [B, Hq, D] float32 or bfloat16, last dim contiguous
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] contiguous, query's dtype
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] contiguous, query's dtype
    block_table: torch.Tensor,  # [B, max_blocks] int64
    context_lens: torch.Tensor,  # [B] int64, each in [1, max_blocks * block_size]
    scale: float,
) -> torch.Tensor:  # [B, Hq, D]
    """Attention of one query token per row over its first ``context_lens[b]`` cached tokens."""
    op = load_cpu_attention_op()
    out: torch.Tensor = op(query, k_cache, v_cache, block_table, context_lens, scale)
    return out


class CpuPagedAttentionBackend:
    """Decode rows through the C++ kernel, prefill spans through the torch reference."""

    def __init__(self) -> None:
        # Compile now, so a broken toolchain surfaces at start-up (where the selector can
        # fall back) rather than in the first forward pass.
        load_cpu_attention_op()

    @property
    def name(self) -> str:
        return "cpu"

    def write_kv_cache(
        self,
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        slot_mapping: torch.Tensor,  # [T] int64
    ) -> None:
        """Store the new tokens' K/V (the reference's index_copy is already a memcpy)."""
        reference.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)

    def paged_attention(
        self,
        query: torch.Tensor,  # [T, Hq, D]
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D]
        """Causal attention of every new token; same contract as ``reference.paged_attention``."""
        out = torch.empty_like(query)  # [T, Hq, D]
        nd = meta.num_decodes
        if nd and query.shape[2] % 16 == 0:  # the kernel's AVX-512 path needs D % 16 == 0
            assert meta.decode_block_table is not None and meta.decode_context_lens is not None
            out[:nd] = decode_attention(
                query[:nd],
                k_cache,
                v_cache,
                meta.decode_block_table,
                meta.decode_context_lens,
                scale,
            )
        elif nd:
            out[:nd] = reference.paged_attention(
                query[:nd],
                key[:nd],
                value[:nd],
                k_cache,
                v_cache,
                dataclasses.replace(meta, num_tokens=nd, prefills=[]),
                scale,
            )
        if meta.prefills:
            num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
            flat_k = k_cache.view(-1, num_kv_heads, head_dim)  # [num_slots, Hkv, D]
            flat_v = v_cache.view(-1, num_kv_heads, head_dim)  # [num_slots, Hkv, D]
            for span in meta.prefills:
                rows = slice(span.token_start, span.token_start + span.num_new_tokens)
                out[rows] = reference._prefill_attention(
                    query[rows], key[rows], value[rows], flat_k, flat_v, span, scale
                )
        return out
