"""Run as a fresh process by tests/integration/test_cpu_ops_loading.py: choose the CPU kernel
backend the way the engine does (``select_kernel_backend("auto")``), check its ops against the
torch reference, and print one JSON line: the backend, the libraries torch loaded and the ops'
largest relative errors. The loader logs to stderr.

    python tests/cpu_ops_probe.py [--library-dir DIR]

``--library-dir`` points the loader at another folder than the package's (an empty one is a
tree without a build).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch


def _rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.float().abs().max().clamp_min(1e-6)
    return float((actual.float() - expected.float()).abs().max() / scale)


def _check_ops(dtype: torch.dtype) -> dict[str, float]:
    """Every op family once, on shapes that take the vector paths (K, D multiples of 32)."""
    from corefleet.kernels import reference
    from corefleet.kernels.backend import KernelBackend
    from corefleet.kernels.cpu import backend as cpu_backend

    ops, oracle = cpu_backend.CpuBackend(), KernelBackend()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 128, generator=gen).to(dtype)
    weight = torch.randn(96, 128, generator=gen).to(dtype)
    bias = torch.randn(96, generator=gen).to(dtype)
    residual = torch.randn(4, 128, generator=gen).to(dtype)
    norm_weight = torch.rand(128, generator=gen).to(dtype)
    errors = {
        "linear": _rel_error(ops.linear(x, weight, bias), oracle.linear(x, weight, bias)),
        "rms_norm": _rel_error(
            ops.rms_norm(x, norm_weight, 1e-6, residual.clone())[0],
            oracle.rms_norm(x, norm_weight, 1e-6, residual.clone())[0],
        ),
        "silu_and_mul": _rel_error(ops.silu_and_mul(x), oracle.silu_and_mul(x)),
        "argmax": float((ops.argmax(x) != oracle.argmax(x)).sum()),
    }
    # Decode attention: rows of 1, 9 and 40 positions over shuffled 16-slot blocks, 2 KV heads
    # of 2 query heads each, head_dim 64.
    lens, bs, hkv, group, dim = [1, 9, 40], 16, 2, 2, 64
    k_cache = torch.randn(8, bs, hkv, dim, generator=gen).to(dtype)
    v_cache = torch.randn(8, bs, hkv, dim, generator=gen).to(dtype)
    table = torch.tensor([[5, 0, 0], [2, 0, 0], [7, 1, 4]])
    query = torch.randn(len(lens), hkv * group, dim, generator=gen).to(dtype)
    mask = torch.arange(3 * bs)[None, :] < torch.tensor(lens)[:, None]
    expected = reference._decode_attention(
        query, k_cache, v_cache, table, mask[:, None, None, :], dim**-0.5
    )
    actual = cpu_backend.paged_attention(
        query, k_cache, v_cache, table, torch.tensor(lens), dim**-0.5
    )
    errors["paged_attention"] = _rel_error(actual, expected)
    return errors


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--library-dir", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)

    from corefleet.kernels.backend_selection import select_kernel_backend
    from corefleet.kernels.cpu import loader

    if args.library_dir is not None:
        loader.LIBRARY_DIR = args.library_dir
    backend = select_kernel_backend("auto", torch.device("cpu"))
    result: dict[str, object] = {"backend": backend.name}
    if backend.name == "cpu":
        result["errors"] = {str(d): _check_ops(d) for d in (torch.float32, torch.bfloat16)}
    result["libraries"] = sorted(torch.ops.loaded_libraries)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
