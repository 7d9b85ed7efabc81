"""Tensor parallelism: decode throughput with 1 and 2 workers, and what their collectives cost
(issue 22).

Per run, side by side in the same run: an engine in this process (``LLM``) with
``tensor_parallel_size`` 1, then 2 (one worker process each, gloo on the CPU, NCCL on GPUs),
``--batch`` requests at once, greedy, ``--tokens`` tokens each: decode tokens/s and the decode
step's median time (from the engine's own outputs: each step adds one token per request).
Then the communication alone: 2 processes doing what one TP=2 decode step does, two
all-reduces of ``[batch, hidden]`` per layer and one all-gather of the logits slice, timed over
many steps.

On this 2-core machine the figures check the plumbing (the 2 workers and the engine share 2
cores), not the scaling: the model is a random Llama written to a temporary folder (``--hidden``,
``--layers``). On a machine with 2 GPUs, pass ``--model PATH --device cuda --batch 64`` to
measure the scaling the issue targets (TP=2 decode step <= 0.6x TP=1 at batch 64).

    python benchmarks/parallel.py --runs 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from corefleet.engine import LLM, SamplingParams
from tests.fixtures_models import write_tiny_model


def decode(model: str, tp: int, args: argparse.Namespace) -> tuple[float, float]:
    """(decode tokens/s, median step ms) of ``--batch`` greedy requests on ``tp`` workers."""
    llm = LLM(
        model,
        multiprocess=False,
        dtype=args.dtype,
        device=args.device,
        kv_cache_memory=512 << 20,
        tensor_parallel_size=tp,
    )
    try:
        prompts = [f"Request {i}: the story of a tensor" for i in range(args.batch)]
        params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
        llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm up
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - started
    finally:
        llm.shutdown()
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return tokens / elapsed, elapsed / args.tokens * 1000


def comm_worker(rank: int, port: int, args: argparse.Namespace) -> None:
    """One of the 2 processes of the communication timing (``--comm-worker RANK``)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    hidden = torch.randn(args.batch, args.hidden)
    logits = torch.randn(args.batch, args.vocab // 2)
    parts = [torch.empty_like(logits) for _ in range(2)]

    def one_step() -> None:
        for _ in range(2 * args.layers):
            dist.all_reduce(hidden)
        dist.all_gather(parts, logits)

    for _ in range(10):
        one_step()
    steps = 200
    started = time.perf_counter()
    for _ in range(steps):
        one_step()
    if rank == 0:
        print(f"{(time.perf_counter() - started) / steps * 1000:.3f}")
    dist.destroy_process_group()


def comm_ms(args: argparse.Namespace) -> float:
    """A TP=2 decode step's collectives alone, in ms (2 processes, gloo)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, __file__, "--batch", str(args.batch), "--hidden", str(args.hidden)]
    argv += ["--layers", str(args.layers), "--vocab", str(args.vocab), "--comm-port", str(port)]
    procs = [
        subprocess.Popen([*argv, "--comm-worker", str(r)], stdout=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    out = [p.communicate(timeout=300)[0] for p in procs]
    return float(out[0].strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--model", default=None, help="a model folder (default: a random Llama)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--hidden", type=int, default=512, help="the random Llama's width")
    parser.add_argument("--layers", type=int, default=8, help="the random Llama's layers")
    parser.add_argument("--vocab", type=int, default=320, help="(communication timing only)")
    parser.add_argument("--comm-worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--comm-port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.comm_worker is not None:
        comm_worker(args.comm_worker, args.comm_port, args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(
            write_tiny_model(
                Path(tmp) / "m",
                hidden_size=args.hidden,
                intermediate_size=args.hidden * 3,
                num_hidden_layers=args.layers,
            )
        )
        rows = []
        for run in range(args.runs):
            one, one_step = decode(model, 1, args)
            two, two_step = decode(model, 2, args)
            comm = comm_ms(args)
            rows.append((one, two, one_step, two_step, comm))
            print(
                f"run {run + 1}: TP=1 {one:.0f} tok/s ({one_step:.1f} ms a step), TP=2 {two:.0f} "
                f"tok/s ({two_step:.1f} ms), collectives of a TP=2 step {comm:.2f} ms",
                flush=True,
            )
    med = [statistics.median(col) for col in zip(*rows, strict=True)]
    print(
        f"median of {args.runs}: TP=1 {med[0]:.0f} tok/s, TP=2 {med[1]:.0f} tok/s "
        f"(step {med[3] / med[2]:.2f}x TP=1's), collectives {med[4]:.2f} ms a step "
        f"(batch {args.batch}, {os.cpu_count()} cores)"
    )


if __name__ == "__main__":
    main()
