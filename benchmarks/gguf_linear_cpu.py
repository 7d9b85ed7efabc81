"""GGUF-quantized linear layers on the CPU: ``gguf_linear`` against the float paths, cold weights.

For each weight shape and GGUF format, and each batch of ``M`` rows, times side by side in one
run (rounds alternate between the methods, medians printed):

- ``gguf_linear`` (``torch.ops.corefleet_cpu``) on the quantized blocks, x float32 and bfloat16;
- ``small_linear`` (the C++ small-batch float op) and torch's ``F.linear`` on the weight
  dequantized once to float32 and to bfloat16 (what keeping the weights in float costs);
- dequantize + ``F.linear`` (``gguf_dequantize`` to x's dtype, then torch's GEMM), the path
  ``CpuBackend.quant_linear`` takes above its row threshold.

Weights are cold, as in a decode step (the model does not fit the caches): each method cycles
through enough copies of its weight to exceed the last-level cache several times. The effective
bandwidth is the quantized bytes over the time (for the float methods: their own bytes).
``--crossover`` times the larger batches where dequantize + GEMM takes over.

``--vnni``: the 1B model's shapes (issue 38) for the formats with a packed form, the integer
linear (``gguf_linear_vnni`` on ``gguf_pack_vnni``'s weights, x float32 and bfloat16) against
the float paths in the same run (``gguf_linear``; dequantize + GEMM from 8 rows), each as GB/s
of the quantized bytes and as a fraction of this machine's read bandwidth (``stream_read``:
1 GiB read once on the same threads, measured before each shape in the same run).

    python benchmarks/gguf_linear_cpu.py
    python benchmarks/gguf_linear_cpu.py --crossover --rounds 7
    python benchmarks/gguf_linear_cpu.py --vnni --threads 1
    python benchmarks/gguf_linear_cpu.py --vnni --threads 2
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from collections.abc import Callable

# As a rank does (engine/): torch's OpenMP threads sleep between regions instead of spinning,
# which on a machine shared with other work turns every GEMM barrier into a time slice.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import torch
import torch.nn.functional as F

from corefleet.kernels.cpu.loader import load_cpu_ops
from corefleet.kernels.gguf_quant import FORMATS_BY_NAME, QuantFormat

# SmolLM2-135M's projections (N outputs, K inputs) and a 7B-sized square one. K = 576 is not a
# multiple of the K-quants' 256-value blocks: those layers use Q8_0/Q4_0/Q4_1 in real files.
SHAPES: dict[str, tuple[int, int]] = {
    "qkv 576->960": (960, 576),
    "gate_up 576->3072": (3072, 576),
    "down 1536->576": (576, 1536),
    "lm_head 576->49152": (49152, 576),
    "square 4096->4096": (4096, 4096),
}
LM_HEAD_FORMATS = ("Q8_0",)  # the embedding/LM head of a Q4 model file is usually Q8_0 or Q6_K
ALL_FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
COLD_BYTES = 128 << 20  # each method's copies together: 4x the 32 MiB L3 of the test machine
# Byte offsets of each format's float16 fields (scales, mins) in a block.
F16_OFFSETS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q8_0": (0,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}

OPS = load_cpu_ops()


def random_qweight(fmt: QuantFormat, n: int, k: int, seed: int) -> torch.Tensor:
    """``[n, row_bytes]`` uint8 of valid blocks: random bytes, small finite float16 scales."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, fmt.row_bytes(k)), dtype=np.uint8)
    blocks = raw.reshape(-1, fmt.block_bytes)
    for offset in F16_OFFSETS[fmt.name]:
        values = rng.uniform(-1e-3, 1e-3, size=(blocks.shape[0], 1)).astype(np.float16)
        blocks[:, offset : offset + 2] = values.view(np.uint8)
    return torch.from_numpy(raw)


def copies(t: torch.Tensor) -> list[torch.Tensor]:
    """Enough copies of ``t`` that cycling through them never hits the cache."""
    count = max(2, -(-COLD_BYTES // (t.numel() * t.element_size())))
    return [t.clone() for _ in range(count)]


Method = Callable[[torch.Tensor], torch.Tensor]  # one call on the given weight copy


def time_methods(
    methods: dict[str, tuple[list[torch.Tensor], Method]], rounds: int, min_s: float
) -> dict[str, float]:
    """Median seconds per call of each method; rounds alternate between the methods."""
    samples: dict[str, list[float]] = {name: [] for name in methods}
    calls: dict[str, int] = {}
    for name, (weights, fn) in methods.items():  # warm-up, and calls per sample
        for w in weights[:2]:
            fn(w)
        start = time.perf_counter()
        fn(weights[2 % len(weights)])
        once = time.perf_counter() - start
        calls[name] = max(len(weights), int(min_s / max(once, 1e-7)))
    for _ in range(rounds):
        for name, (weights, fn) in methods.items():
            start = time.perf_counter()
            for i in range(calls[name]):
                fn(weights[i % len(weights)])
            samples[name].append((time.perf_counter() - start) / calls[name])
    return {name: statistics.median(s) for name, s in samples.items()}


def bench_shape(
    label: str, fmt: QuantFormat, m_values: list[int], rounds: int, min_s: float
) -> None:
    n, k = SHAPES[label]
    q = random_qweight(fmt, n, k, seed=n + k)
    qbytes = q.numel()
    qs = copies(q)
    w32 = OPS.gguf_dequantize(q, fmt.ggml_type, k, torch.float32)
    w32s = copies(w32)
    w16s = copies(w32.bfloat16())
    del w32
    t = fmt.ggml_type
    print(f"\n{label}, {fmt.name}: {qbytes / 1e6:.2f} MB quantized ({len(qs)} copies)")
    print(
        "   M | gguf f32 µs  GB/s | gguf bf16 µs  GB/s | small f32 µs  GB/s | small bf16 µs "
        "| torch f32 µs | torch bf16 µs | deq+mm f32 µs | deq+mm bf16 µs | vs small f32"
    )
    for m in m_values:
        x32 = torch.randn(m, k)
        x16 = x32.bfloat16()
        methods: dict[str, tuple[list[torch.Tensor], Method]] = {
            "gguf32": (qs, lambda w, x=x32: OPS.gguf_linear(x, w, t, None)),
            "gguf16": (qs, lambda w, x=x16: OPS.gguf_linear(x, w, t, None)),
            "deq32": (qs, lambda w, x=x32: F.linear(x, OPS.gguf_dequantize(w, t, k, x.dtype))),
            "deq16": (qs, lambda w, x=x16: F.linear(x, OPS.gguf_dequantize(w, t, k, x.dtype))),
            "torch32": (w32s, lambda w, x=x32: F.linear(x, w)),
            "torch16": (w16s, lambda w, x=x16: F.linear(x, w)),
        }
        if m <= 64:
            methods["small32"] = (w32s, lambda w, x=x32: OPS.small_linear(x, w, None))
            methods["small16"] = (w16s, lambda w, x=x16: OPS.small_linear(x, w, None))
        us = {name: s * 1e6 for name, s in time_methods(methods, rounds, min_s).items()}
        small32 = us.get("small32", float("nan"))
        small16 = us.get("small16", float("nan"))
        print(
            f"{m:4d} | {us['gguf32']:11.1f} {qbytes / us['gguf32'] / 1e3:5.1f} "
            f"| {us['gguf16']:12.1f} {qbytes / us['gguf16'] / 1e3:5.1f} "
            f"| {small32:12.1f} {4 * n * k / small32 / 1e3:5.1f} | {small16:13.1f} "
            f"| {us['torch32']:12.1f} | {us['torch16']:13.1f} "
            f"| {us['deq32']:13.1f} | {us['deq16']:14.1f} | {small32 / us['gguf32']:5.2f}x",
            flush=True,
        )


# The 1B model's projections (N, K) and the formats timed on each (its file: Q4_0 layers, Q8_0
# tied embedding/LM head).
VNNI_SHAPES: dict[str, tuple[int, int]] = {
    "qo 2048->2048": (2048, 2048),
    "kv 2048->512": (512, 2048),
    "gate_up 2048->16384": (16384, 2048),
    "down 8192->2048": (2048, 8192),
    "lm_head 2048->49152": (49152, 2048),
}
VNNI_FORMATS = ("Q4_0", "Q4_1", "Q8_0")


def read_bandwidth(rounds: int = 5) -> float:
    """GB/s of a plain streaming read of 1 GiB on the current threads (median): our
    ``stream_read`` op (64-byte loads XOR-ed together, 64 KiB chunks on the ops' pool)."""
    big = torch.ones(1 << 30, dtype=torch.uint8)
    OPS.stream_read(big)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        OPS.stream_read(big)
        times.append(time.perf_counter() - start)
    return (1 << 30) / statistics.median(times) / 1e9


def bench_vnni(
    label: str, fmt: QuantFormat, m_values: list[int], rounds: int, min_s: float
) -> None:
    n, k = VNNI_SHAPES[label]
    q = random_qweight(fmt, n, k, seed=n + k)
    qbytes = q.numel()
    qs = copies(q)
    ps = copies(OPS.gguf_pack_vnni(q, fmt.ggml_type))
    t = fmt.ggml_type
    bw = read_bandwidth()
    print(f"\n{label}, {fmt.name}: {qbytes / 1e6:.1f} MB; read bandwidth {bw:.1f} GB/s")
    print("   M | method          ms     GB/s  of read bw | vs best old")
    for m in m_values:
        x32 = torch.randn(m, k)
        x16 = x32.bfloat16()
        methods: dict[str, tuple[list[torch.Tensor], Method]] = {
            "old gguf f32": (qs, lambda w, x=x32: OPS.gguf_linear(x, w, t, None)),
            "old gguf bf16": (qs, lambda w, x=x16: OPS.gguf_linear(x, w, t, None)),
            "new vnni f32": (ps, lambda w, x=x32: OPS.gguf_linear_vnni(x, w, t, n, None)),
            "new vnni bf16": (ps, lambda w, x=x16: OPS.gguf_linear_vnni(x, w, t, n, None)),
        }
        if m >= 8:
            methods["old deq+mm bf16"] = (
                qs,
                lambda w, x=x16: F.linear(x, OPS.gguf_dequantize(w, t, k, x.dtype)),
            )
        if m >= 128:  # the float32 register path is far behind there: one round of it
            del methods["old gguf f32"]
        secs = time_methods(methods, rounds, min_s)
        best_old = min(s for name, s in secs.items() if name.startswith("old"))
        for name, sec in secs.items():
            gbs = qbytes / sec / 1e9
            print(
                f"{m:4d} | {name:15s} {sec * 1e3:7.3f} {gbs:6.1f} {gbs / bw:8.0%} "
                f"| {best_old / sec:5.2f}x",
                flush=True,
            )


def main_vnni(args: argparse.Namespace) -> None:
    for label in VNNI_SHAPES:
        names = ("Q8_0",) if label.startswith("lm_head") else VNNI_FORMATS
        for name in names:
            if name in args.formats:
                bench_vnni(label, FORMATS_BY_NAME[name], args.m, args.rounds, args.min_ms / 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="samples per method (median)")
    parser.add_argument("--min-ms", type=float, default=20.0, help="time per sample")
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--formats", nargs="*", default=list(ALL_FORMATS), choices=ALL_FORMATS)
    parser.add_argument("--m", nargs="*", type=int, default=[1, 4, 16, 64], help="batch rows")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument(
        "--crossover", action="store_true", help="batches of 8-256 rows instead of --m"
    )
    parser.add_argument(
        "--vnni", action="store_true", help="the integer linear on the 1B shapes (see above)"
    )
    args = parser.parse_args()
    m_values = [8, 16, 32, 64, 96, 128, 192, 256] if args.crossover else args.m
    gc.disable()  # a collection inside a sample would count against whichever method ran
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if args.vnni:
        main_vnni(args)
        return
    for label in args.shapes:
        k = SHAPES[label][1]
        names = LM_HEAD_FORMATS if label.startswith("lm_head") else args.formats
        for name in names:
            fmt = FORMATS_BY_NAME[name]
            if name not in args.formats:
                continue
            if k % fmt.block_elems:
                print(f"\n{label}, {name}: skipped (K={k} is not a multiple of {fmt.block_elems})")
                continue
            bench_shape(label, fmt, m_values, args.rounds, args.min_ms / 1e3)


if __name__ == "__main__":
    main()
