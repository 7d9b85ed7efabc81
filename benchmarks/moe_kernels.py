"""Fused mixture-of-experts on the CPU: the C++ op against the per-expert loop, side by side.

For each layer shape, dtype and batch of ``T`` tokens, times in one run (rounds alternate
between the methods, medians printed):

- ``loop``: ``reference.fused_moe``, the per-expert Python loop (the ``torch`` backend's
  ``fused_moe``): a nonzero() per expert, then gather, two matmuls, SwiGLU, index_add;
- ``cpu``: ``CpuBackend.fused_moe``, the C++ op at the backend's threshold (experts with
  fewer rows than ``FUSED_MOE_GEMM_MIN_ROWS`` streamed through its own tiles, larger groups
  on torch's GEMM);
- ``op+gemm``: the same op with every expert on torch's GEMM (``gemm_min_rows=1``): the
  grouping and the fused combine without the streaming tiles.

Each round draws a new batch and routing (top-k of random router logits), so a decode step
reads other experts' weights than the last one, as in a model, whose experts do not fit the
caches. ``GB/s``: the weight bytes of the experts the batch touches over the ``cpu`` time.
``--crossover`` times the op with every expert streamed against every expert on the GEMM at
growing rows per expert (8 experts, top-2), which is where ``FUSED_MOE_GEMM_MIN_ROWS`` comes
from. ``--hogs N`` runs N busy loops (nice 19, each in its own session, as
``shared_cores.py``'s neighbour) on the same cores while measuring.

    python benchmarks/moe_kernels.py
    python benchmarks/moe_kernels.py --hogs 2 --shapes olmoe --tokens 1 8 256
    python benchmarks/moe_kernels.py --crossover
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

# As a rank does (engine/): torch's OpenMP threads sleep between regions instead of spinning,
# which on a machine shared with other work turns every GEMM barrier into a time slice.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from corefleet.kernels import reference
from corefleet.kernels.cpu.backend import FUSED_MOE_GEMM_MIN_ROWS, CpuBackend


@dataclass(frozen=True)
class Shape:
    """One MoE layer: hidden size, expert intermediate size, experts, experts per token."""

    hidden: int
    inter: int
    experts: int
    top_k: int


SHAPES = {
    "olmoe": Shape(2048, 1024, 64, 8),  # OLMoE-1B-7B
    "qwen3": Shape(2048, 768, 128, 8),  # Qwen3-30B-A3B's experts at hidden 2048 (it has 4096)
}
CROSSOVER_SHAPE = Shape(2048, 1024, 8, 2)  # T * 2 / 8 rows per expert
HOG = "while :; do :; done"  # a busy loop with no memory traffic: pure CPU contention
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # x [T, H], weights [T, K], ids [T, K]
Method = Callable[[Batch], torch.Tensor]


def weights(shape: Shape, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [E, 2I, H] and w2 [E, H, I], scaled so every projection's output is O(1)."""
    gen = torch.Generator().manual_seed(0)
    e, h, i = shape.experts, shape.hidden, shape.inter
    w13 = torch.empty(e, 2 * i, h, dtype=dtype)
    w2 = torch.empty(e, h, i, dtype=dtype)
    for expert in range(e):  # one expert at a time: no float32 copy of the whole layer
        w13[expert] = torch.randn(2 * i, h, generator=gen) / h**0.5
        w2[expert] = torch.randn(h, i, generator=gen) / i**0.5
    return w13, w2


def batch(shape: Shape, tokens: int, dtype: torch.dtype, seed: int) -> Batch:
    """A batch of ``tokens`` rows and their router's top-k (softmax weights, distinct ids)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, shape.hidden, generator=gen).to(dtype)  # [T, H]
    logits = torch.randn(tokens, shape.experts, generator=gen)  # [T, E]
    topk_weights, topk_ids = torch.topk(torch.softmax(logits, -1), shape.top_k, dim=-1)
    return x, topk_weights.contiguous(), topk_ids.contiguous()


def time_rounds(methods: dict[str, Method], batches: list[Batch]) -> dict[str, float]:
    """Median seconds of each method over ``batches``, methods alternating within a round."""
    for method in methods.values():  # warm-up: first-call allocations, the ops' pool
        method(batches[0])
    times: dict[str, list[float]] = {name: [] for name in methods}
    for b in batches:
        for name, method in methods.items():
            start = time.perf_counter()
            method(b)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def touched_bytes(shape: Shape, b: Batch, dtype: torch.dtype) -> int:
    """Bytes of the weights of the experts ``b`` routes to (each read once per call)."""
    experts = int(torch.unique(b[2]).numel())
    per_expert = 3 * shape.hidden * shape.inter * torch.tensor([], dtype=dtype).element_size()
    return experts * per_expert


def methods_for(w13: torch.Tensor, w2: torch.Tensor) -> dict[str, Method]:
    """The three methods of the table, bound to one layer's weights."""
    cpu = CpuBackend()
    return {
        "loop": lambda b: reference.fused_moe(b[0], w13, w2, b[1], b[2]),
        "cpu": lambda b: cpu.fused_moe(b[0], w13, w2, b[1], b[2]),
        "op+gemm": op_method(w13, w2, 1),
    }


def op_method(w13: torch.Tensor, w2: torch.Tensor, gemm_min_rows: int) -> Method:
    """The C++ op itself with an explicit ``gemm_min_rows``."""
    ops = CpuBackend()._ops
    return lambda b: ops.fused_moe(b[0], w13, w2, b[1], b[2], gemm_min_rows)


def check(methods: dict[str, Method], b: Batch, dtype: torch.dtype) -> None:
    """Every method's output equals the loop's (within the dtype's rounding): a benchmark of a
    wrong kernel would be worthless."""
    expected = methods["loop"](b).float()
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    for name, method in methods.items():
        got = method(b).float()
        if not torch.allclose(got, expected, rtol=tol, atol=tol):
            raise SystemExit(f"{name} differs from the loop: {(got - expected).abs().max()}")


def table(args: argparse.Namespace) -> None:
    print("| shape | dtype | T | loop ms | cpu ms | op+gemm ms | cpu vs loop | cpu GB/s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for shape_name in args.shapes:
        shape = SHAPES[shape_name]
        for dtype_name in args.dtypes:
            dtype = DTYPES[dtype_name]
            w13, w2 = weights(shape, dtype)
            methods = methods_for(w13, w2)
            check(methods, batch(shape, 5, dtype, seed=-1), dtype)
            for tokens in args.tokens:
                runs = args.runs if tokens <= 64 else args.prefill_runs
                batches = [batch(shape, tokens, dtype, seed) for seed in range(runs)]
                med = time_rounds(methods, batches)
                gbs = statistics.median(touched_bytes(shape, b, dtype) for b in batches)
                gbs /= med["cpu"] * 1e9
                print(
                    f"| {shape_name} | {dtype_name} | {tokens} | {med['loop'] * 1e3:.2f} "
                    f"| {med['cpu'] * 1e3:.2f} | {med['op+gemm'] * 1e3:.2f} "
                    f"| **{med['loop'] / med['cpu']:.2f}×** | {gbs:.1f} |",
                    flush=True,
                )
            del w13, w2, methods


def crossover(args: argparse.Namespace) -> None:
    shape = CROSSOVER_SHAPE
    print(f"crossover: {shape}; streamed = gemm_min_rows 257, gemm = gemm_min_rows 1")
    print("| dtype | T | rows/expert | streamed ms | gemm ms | gemm / streamed |")
    print("|---|---:|---:|---:|---:|---:|")
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        w13, w2 = weights(shape, dtype)
        for tokens in (64, 128, 256, 512, 1024):
            batches = [batch(shape, tokens, dtype, seed) for seed in range(args.runs)]
            methods = {
                name: op_method(w13, w2, rows) for name, rows in (("streamed", 257), ("gemm", 1))
            }
            med = time_rounds(methods, batches)
            rows = tokens * shape.top_k // shape.experts
            print(
                f"| {dtype_name} | {tokens} | {rows} | {med['streamed'] * 1e3:.2f} "
                f"| {med['gemm'] * 1e3:.2f} | {med['gemm'] / med['streamed']:.2f} |",
                flush=True,
            )


@contextlib.contextmanager
def busy_neighbours(count: int) -> Iterator[None]:
    """``count`` busy loops at nice 19, each in its own session, killed on exit."""
    procs = [
        subprocess.Popen(["nice", "-n", "19", "sh", "-c", HOG], start_new_session=True)
        for _ in range(count)
    ]
    try:
        yield
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 2, 4, 8, 256, 512])
    p.add_argument("--runs", type=int, default=9, help="rounds per decode-sized batch (9)")
    p.add_argument("--prefill-runs", type=int, default=5, help="rounds for T > 64 (5)")
    p.add_argument("--hogs", type=int, default=0, help="busy loops beside the benchmark (0)")
    p.add_argument("--crossover", action="store_true", help="streamed vs GEMM by rows/expert")
    args = p.parse_args()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.hogs} hogs; "
        f"FUSED_MOE_GEMM_MIN_ROWS = { {str(k): v for k, v in FUSED_MOE_GEMM_MIN_ROWS.items()} }"
    )
    with busy_neighbours(args.hogs):
        if args.crossover:
            crossover(args)
        else:
            table(args)


if __name__ == "__main__":
    main()
