"""The KV cache's memory: on CPU committed as it is written, on GPU zeroed up front.

On CPU the cache is one anonymous ``mmap`` for every layer's K and V. The kernel hands out such
pages only when they are first written (and they read as zeros until then), so a rank holds
what its requests have written, not its whole budget: a 4 GiB budget costs nothing at start
and grows with the tokens held. Blocks freed by finished requests stay committed and are
reused. ``torch.zeros`` instead wrote every page at start (the whole budget resident from the
first second), and ``torch.empty`` gives recycled heap memory for sizes under glibc's mmap
threshold (up to 32 MiB), which may hold anything, NaN included.

Attention never lets a slot past a request's context reach its output (the C++ and Triton
kernels read only positions inside it; the torch reference zeroes the gathered positions past
it), so what an unwritten or stale slot holds does not matter; the zero pages are a second
guard, not the first. The price of committing on first write is a page fault per 4 KiB written
the first time (~30 us per token of SmolLM2's float32 cache on the project's machine, measured
in benchmarks/README.md "Memory"), paid once per page over the cache's life rather than all at
start.

On a GPU the budget is reserved memory anyway (``--gpu-memory-utilization``), so the cache is
zeroed there, as before.
"""

from __future__ import annotations

import mmap

import torch

KVCache = tuple[torch.Tensor, torch.Tensor]  # k_cache, v_cache: [num_blocks, bs, Hkv, D]

_ALIGN = mmap.PAGESIZE  # every tensor starts on its own page


def allocate_kv_cache(
    num_layers: int,
    shape: tuple[int, ...],  # [num_blocks, block_size, Hkv, D]
    dtype: torch.dtype,
    device: torch.device,
) -> list[KVCache]:
    """One (k_cache, v_cache) pair per layer, each ``shape``, reading as zeros."""
    if device.type != "cpu":
        return [
            (
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
            )
            for _ in range(num_layers)
        ]
    numel = 1
    for size in shape:
        numel *= size
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    stride = -(-nbytes // _ALIGN) * _ALIGN  # bytes from one tensor's start to the next
    total = max(stride * 2 * num_layers, _ALIGN)
    # Anonymous and private: zero pages, committed on first write, freed with the last view.
    memory = torch.frombuffer(mmap.mmap(-1, total), dtype=torch.uint8)  # [total] bytes

    def tensor(index: int) -> torch.Tensor:
        start = index * stride
        return memory[start : start + nbytes].view(dtype).view(shape)

    return [(tensor(2 * layer), tensor(2 * layer + 1)) for layer in range(num_layers)]
