"""Quantized CPU matmuls of maintained libraries against ours, on the 1B model's shapes (issue 38
item 0: "library first").

For each weight shape (the 1B Llama: hidden 2048, 8 KV heads of 64, MLP 8192, vocabulary 49152)
and each batch of ``M`` rows, times side by side in one run (rounds alternate between the
methods; medians printed), weights cold (each method cycles through copies of its weight that
together exceed the last-level cache several times):

- ``int4pack``: ``torch.ops.aten._weight_int4pack_mm_for_cpu`` on the Q4_0 weight converted with
  ``_convert_weight_to_int4pack_for_cpu``, group size 32, scale = the block's d, zero = 0: its
  rule ``(q - 8) * scale + zero`` is Q4_0's ``d * (q - 8)`` (checked at start against
  ``kernels/gguf_quant.dequantize``; float32 x and scales: exact; bfloat16 scales would round d);
- ``int8pack``: ``torch.ops.aten._weight_int8pack_mm`` (int8 weight, one scale per output row:
  not Q8_0's per-32 scales, timed anyway);
- ``dyn-fbgemm`` / ``dyn-onednn``: ``torch.ops.quantized.linear_dynamic`` (activations quantized
  per tensor on the fly, int8 per-channel weights: neither GGUF's semantics) on each engine;
- ``ggml``: ggml's own ``ggml_mul_mat`` through ctypes (``ggml_ctypes.py``), when ``--ggml-lib``
  names the folder of its libraries;
- ours: ``gguf_linear`` (float32 and bfloat16 x) and dequantize + ``F.linear`` in bfloat16 (the
  prefill path), plus ``gguf_linear_vnni`` when the loaded build has it.

GB/s is each method's own weight bytes (its packed weight and scales) over its time; the
figure printed first is the machine's plain streaming read (``stream_read``: 1 GiB read once) at
1 and 2 threads, measured in the same run.

    python benchmarks/cpu_matmul_libraries.py
    python benchmarks/cpu_matmul_libraries.py --m 1 32 --shapes qo down --rounds 7
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from ggml_ctypes import GgmlMatmul, load_ggml
from gguf_linear_cpu import random_qweight, read_bandwidth

from corefleet.kernels import gguf_quant
from corefleet.kernels.cpu.loader import load_cpu_ops

# The 1B model's projections: (N outputs, K inputs, the format its file uses).
SHAPES: dict[str, tuple[int, int, str]] = {
    "qo": (2048, 2048, "Q4_0"),
    "kv": (512, 2048, "Q4_0"),
    "gate_up": (8192, 2048, "Q4_0"),
    "down": (2048, 8192, "Q4_0"),
    "lm_head": (49152, 2048, "Q8_0"),
}
COLD_BYTES = 128 << 20  # each method's copies together: 4x the 32 MiB L3
OPS = load_cpu_ops()
Method = tuple[list[tuple[torch.Tensor, ...]], Callable[..., torch.Tensor], int]  # copies, fn, B


def cold(*tensors: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """Enough copies of a method's weight tensors that cycling through them misses the cache."""
    size = sum(t.numel() * t.element_size() for t in tensors)
    count = max(2, -(-COLD_BYTES // size))
    return [tuple(t.clone() for t in tensors) for _ in range(count)]


def median_seconds(methods: dict[str, Method], rounds: int, min_s: float) -> dict[str, float]:
    """Median seconds per call of each method; rounds alternate between the methods."""
    samples: dict[str, list[float]] = {name: [] for name in methods}
    calls: dict[str, int] = {}
    for name, (weights, fn, _) in methods.items():
        fn(*weights[0])
        start = time.perf_counter()
        fn(*weights[1 % len(weights)])
        calls[name] = max(len(weights), int(min_s / max(time.perf_counter() - start, 1e-7)))
    for _ in range(rounds):
        for name, (weights, fn, _) in methods.items():
            start = time.perf_counter()
            for i in range(calls[name]):
                fn(*weights[i % len(weights)])
            samples[name].append((time.perf_counter() - start) / calls[name])
    return {name: statistics.median(s) for name, s in samples.items()}


def q4_0_as_int4pack(q: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q4_0 weight as int4pack's operands: the packed nibbles and [K/32, N, 2] float32
    (scale, zero) with scale = d, zero = 0."""
    blocks = q.reshape(n, k // 32, 18)
    d = blocks[:, :, :2].contiguous().view(torch.float16).float().reshape(n, k // 32)
    nib = blocks[:, :, 2:]
    values = torch.stack((nib & 0x0F, nib >> 4), dim=2).reshape(n, k).to(torch.int32)  # [N, K]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, 1)
    scale_zero = torch.stack((d.t(), torch.zeros_like(d.t())), dim=-1).contiguous()
    return packed, scale_zero


def check_int4pack_semantics() -> float:
    """Max relative difference of int4pack to F.linear on the dequantized Q4_0 weight."""
    n, k = 256, 512
    q = random_qweight(gguf_quant.Q4_0, n, k, seed=1)
    packed, scale_zero = q4_0_as_int4pack(q, n, k)
    x = torch.randn(3, k)
    got = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, scale_zero)
    want = F.linear(x, gguf_quant.dequantize(q, gguf_quant.Q4_0, k))
    return float((got - want).abs().max() / want.abs().max())


def read_bandwidth_at(threads: int, rounds: int) -> float:
    """GB/s of a plain streaming read of 1 GiB on ``threads`` threads (``stream_read``)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return read_bandwidth(rounds)
    finally:
        torch.set_num_threads(saved)


def methods_for(
    label: str, m: int, ggml: tuple[ctypes.CDLL, ctypes.CDLL] | None
) -> dict[str, Method]:
    n, k, fmt_name = SHAPES[label]
    fmt = gguf_quant.FORMATS_BY_NAME[fmt_name]
    t = fmt.ggml_type
    q = random_qweight(fmt, n, k, seed=n + k)
    x32 = torch.randn(m, k)
    x16 = x32.bfloat16()
    w = gguf_quant.dequantize(q, fmt, k)  # [N, K] float32, for the other libraries' operands
    methods: dict[str, Method] = {}
    qs = cold(q)
    methods["gguf f32"] = (qs, lambda w: OPS.gguf_linear(x32, w, t, None), q.numel())
    methods["gguf bf16"] = (qs, lambda w: OPS.gguf_linear(x16, w, t, None), q.numel())
    if hasattr(OPS, "gguf_linear_vnni"):
        p = OPS.gguf_pack_vnni(q, t)
        methods["vnni f32"] = (
            cold(p),
            lambda w: OPS.gguf_linear_vnni(x32, w, t, n, None),
            p.numel(),
        )
    methods["deq+mm bf16"] = (
        qs,
        lambda w: F.linear(x16, OPS.gguf_dequantize(w, t, k, torch.bfloat16)),
        q.numel(),
    )
    if fmt_name == "Q4_0":
        packed, scale_zero = q4_0_as_int4pack(q, n, k)
    if fmt_name == "Q4_0" and m == 1:  # float32 x: a plain loop, 35x slower already at M=1
        methods["int4pack f32"] = (
            cold(packed, scale_zero),
            lambda p, s: torch.ops.aten._weight_int4pack_mm_for_cpu(x32, p, 32, s),
            packed.numel() + scale_zero.numel() * 4,
        )
    if fmt_name == "Q4_0":
        sz16 = scale_zero.bfloat16()  # d rounded to bfloat16: no longer Q4_0's exact values
        methods["int4pack bf16"] = (
            cold(packed, sz16),
            lambda p, s: torch.ops.aten._weight_int4pack_mm_for_cpu(x16, p, 32, s),
            packed.numel() + sz16.numel() * 2,
        )
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127  # [N] per-channel
    w8 = torch.round(w / scale[:, None]).to(torch.int8)
    methods["int8pack bf16"] = (
        cold(w8, scale.bfloat16()),
        lambda w, s: torch.ops.aten._weight_int8pack_mm(x16, w, s),
        w8.numel() + 2 * n,
    )
    zeros = torch.zeros(n, dtype=torch.long)
    qw = torch.quantize_per_channel(w, scale.double(), zeros, 0, torch.qint8)
    for engine in ("fbgemm", "onednn"):
        torch.backends.quantized.engine = engine
        packed_dyn = torch.ops.quantized.linear_prepack(qw, None)
        dyn = [(packed_dyn,)] + [
            (torch.ops.quantized.linear_prepack(qw.clone(), None),)
            for _ in range(max(1, COLD_BYTES // (n * k) - 1))
        ]
        methods[f"dyn-{engine}"] = (
            dyn,  # type: ignore[dict-item]
            lambda p, e=engine: _dynamic(e, x32, p),
            n * k + 4 * n,
        )
    if ggml is not None:
        copies = max(2, -(-COLD_BYTES // q.numel()))
        mm = GgmlMatmul(ggml, q, fmt_name, x32, copies, torch.get_num_threads())
        methods["ggml"] = ([(i,) for i in range(copies)], mm.run, q.numel())  # type: ignore[dict-item]
    return methods


def _dynamic(engine: str, x: torch.Tensor, packed: object) -> torch.Tensor:
    torch.backends.quantized.engine = engine
    out: torch.Tensor = torch.ops.quantized.linear_dynamic(x, packed, False)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--min-ms", type=float, default=30.0, help="time per sample")
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--m", nargs="*", type=int, default=[1, 8, 32, 512])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument(
        "--ggml-lib", default=None, help="folder of libggml-base.so and libggml-cpu.so"
    )
    args = parser.parse_args()
    gc.disable()
    warnings.filterwarnings("ignore", message=".*quantize_per_channel.*")
    torch.set_num_threads(args.threads)
    ggml = load_ggml(args.ggml_lib) if args.ggml_lib else None
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"int4pack vs dequantized Q4_0, max rel diff: {check_int4pack_semantics():.2e}")
    bw = {t: read_bandwidth_at(t, args.rounds) for t in (1, 2)}
    print(f"read bandwidth (stream_read, 1 GiB): 1 thread {bw[1]:.1f} GB/s, 2 threads {bw[2]:.1f}")
    for label in args.shapes:
        n, k, fmt_name = SHAPES[label]
        print(f"\n{label} K={k} -> N={n} ({fmt_name} file weight)")
        for m in args.m:
            methods = methods_for(label, m, ggml)
            rounds = args.rounds if m < 512 else max(3, args.rounds // 2)
            secs = median_seconds(methods, rounds, args.min_ms / 1e3)
            cells = [
                f"{name} {s * 1e3:.3f} ms {methods[name][2] / s / 1e9:.1f} GB/s"
                for name, s in secs.items()
            ]
            print(f"  M={m:4d}: " + " | ".join(cells), flush=True)
            del methods
            gc.collect()


if __name__ == "__main__":
    main()
