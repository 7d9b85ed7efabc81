"""ggml's quantized matmul called through ctypes, for ``cpu_matmul_libraries.py``.

One ``ggml_mul_mat`` graph per weight copy, each in its own ggml context holding the weight's
GGUF blocks (ggml's block structs are the file's bytes), x (float32) and the output; a run is
``ggml_graph_compute_with_ctx`` on one graph. This is ggml's plain CPU path (x quantized to
Q8_0 per block, ``ggml_vec_dot_q4_0_q8_0`` / ``q8_0_q8_0``); the weight repacking llama-server
adds through its CPU "repack" buffer type is a backend feature not reachable from a plain
context. The compute call starts its own threads each time (no persistent threadpool).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

GGML_TYPES = {"F32": 0, "Q4_0": 2, "Q8_0": 8}


class _InitParams(ctypes.Structure):
    _fields_ = [
        ("mem_size", ctypes.c_size_t),
        ("mem_buffer", ctypes.c_void_p),
        ("no_alloc", ctypes.c_bool),
    ]


def load_ggml(lib_dir: str) -> tuple[ctypes.CDLL, ctypes.CDLL]:
    """libggml-base (contexts, tensors, graphs) and libggml-cpu (compute) from ``lib_dir``."""

    def find(stem: str) -> str:  # libggml-base.so or a versioned name (pip wheels drop links)
        found = sorted(Path(lib_dir).glob(f"{stem}.so*"))
        if not found:
            raise FileNotFoundError(f"no {stem}.so* in {lib_dir}")
        return str(found[0])

    base = ctypes.CDLL(find("libggml-base"), mode=ctypes.RTLD_GLOBAL)
    cpu = ctypes.CDLL(find("libggml-cpu"), mode=ctypes.RTLD_GLOBAL)
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    base.ggml_init.restype, base.ggml_init.argtypes = vp, [_InitParams]
    base.ggml_new_tensor_2d.restype = vp
    base.ggml_new_tensor_2d.argtypes = [vp, ctypes.c_int, i64, i64]
    base.ggml_mul_mat.restype, base.ggml_mul_mat.argtypes = vp, [vp, vp, vp]
    base.ggml_new_graph.restype, base.ggml_new_graph.argtypes = vp, [vp]
    base.ggml_build_forward_expand.restype = None
    base.ggml_build_forward_expand.argtypes = [vp, vp]
    base.ggml_get_data.restype, base.ggml_get_data.argtypes = vp, [vp]
    cpu.ggml_graph_compute_with_ctx.restype = ctypes.c_int
    cpu.ggml_graph_compute_with_ctx.argtypes = [vp, vp, ctypes.c_int]
    if hasattr(cpu, "ggml_cpu_init"):
        cpu.ggml_cpu_init()
    return base, cpu


class GgmlMatmul:
    """``copies`` graphs of out[M, N] = x[M, K] @ W[N, K]^T, W given as GGUF blocks."""

    def __init__(
        self,
        libs: tuple[ctypes.CDLL, ctypes.CDLL],
        qweight: torch.Tensor,  # [N, row_bytes] uint8, file layout
        fmt_name: str,
        x: torch.Tensor,  # [M, K] float32
        copies: int,
        threads: int,
    ) -> None:
        self.base, self.cpu = libs
        self.threads = threads
        n, m, k = qweight.shape[0], x.shape[0], x.shape[1]
        size = qweight.numel() + 4 * (2 * m * k + m * n) + (16 << 20)  # x, its Q8_0, out
        self.graphs: list[tuple[int, int]] = []  # (context, graph)
        for _ in range(copies):
            ctx = self.base.ggml_init(_InitParams(size, None, False))
            w = self.base.ggml_new_tensor_2d(ctx, GGML_TYPES[fmt_name], k, n)
            b = self.base.ggml_new_tensor_2d(ctx, GGML_TYPES["F32"], k, m)
            ctypes.memmove(self.base.ggml_get_data(w), qweight.data_ptr(), qweight.numel())
            ctypes.memmove(self.base.ggml_get_data(b), x.data_ptr(), 4 * m * k)
            out = self.base.ggml_mul_mat(ctx, w, b)
            graph = self.base.ggml_new_graph(ctx)
            self.base.ggml_build_forward_expand(graph, out)
            self.graphs.append((ctx, graph))
            self.last_out = (out, m, n)

    def run(self, index: int) -> None:
        ctx, graph = self.graphs[index]
        status = self.cpu.ggml_graph_compute_with_ctx(ctx, graph, self.threads)
        if status != 0:
            raise RuntimeError(f"ggml_graph_compute_with_ctx returned {status}")

    def output(self) -> torch.Tensor:  # [M, N] float32 of the last graph
        out, m, n = self.last_out
        buf = (ctypes.c_float * (m * n)).from_address(self.base.ggml_get_data(out))
        return torch.frombuffer(buf, dtype=torch.float32).reshape(m, n).clone()
