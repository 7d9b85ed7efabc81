"""Machine ceilings measured in the same run as the benchmark: GEMM peak and memory bandwidth."""

from __future__ import annotations

import statistics
import time

import torch


def gemm_peak_flops(
    shapes: list[tuple[int, int, int]], dtype: torch.dtype, repeats: int = 5
) -> float:
    """Best FLOP/s of ``torch.matmul`` over the given (M, K, N) shapes (the model's own)."""
    best = 0.0
    for m, k, n in shapes:
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        torch.matmul(a, b)  # warm-up
        iters = max(1, int(2e9 // (2 * m * k * n)))
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(iters):
                torch.matmul(a, b)
            times.append((time.perf_counter() - t0) / iters)
        best = max(best, 2 * m * k * n / statistics.median(times))
    return best


def memory_bandwidth(num_bytes: int = 512 << 20, repeats: int = 5) -> float:
    """Bytes/s moved by a large tensor copy (read + write counted)."""
    src = torch.empty(num_bytes // 4, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * num_bytes / statistics.median(times)
