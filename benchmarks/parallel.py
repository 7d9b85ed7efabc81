"""Tensor and pipeline parallelism: decode throughput with one worker, two tensor-parallel
workers and two pipeline stages, and what their communication costs (issue 22).

Per run, side by side in the same run: an engine in this process (``LLM``) with one worker,
then ``tensor_parallel_size=2``, then ``pipeline_parallel_size=2`` (one worker process each,
gloo on the CPU, NCCL on GPUs), ``--batch`` requests at once, greedy, ``--tokens`` tokens each:
decode tokens/s and the time a step takes (the run's time over the tokens of a request).
Then the communication alone, in 2 processes: what one TP=2 decode step does (two all-reduces
of ``[batch, hidden]`` per layer and one all-gather of the logits slice) and what a PP=2 step
does (the hidden states and the residual sent from one stage to the next), timed over many
steps.

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


def decode(model: str, tp: int, pp: int, args: argparse.Namespace) -> tuple[float, float]:
    """(decode tokens/s, ms a step) of ``--batch`` greedy requests on ``tp`` x ``pp`` workers."""
    llm = LLM(
        model,
        multiprocess=False,
        dtype=args.dtype,
        device=args.device,
        kv_cache_memory=512 << 20,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
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

    residual = torch.randn(args.batch, args.hidden)

    def tp_step() -> None:
        for _ in range(2 * args.layers):
            dist.all_reduce(hidden)
        dist.all_gather(parts, logits)

    def pp_step() -> None:  # stage 0 sends, stage 1 receives
        for tensor in (hidden, residual):
            if rank == 0:
                dist.send(tensor, dst=1)
            else:
                dist.recv(tensor, src=0)

    times = []
    for step in (tp_step, pp_step):
        for _ in range(10):
            step()
        dist.barrier()
        steps = 200
        started = time.perf_counter()
        for _ in range(steps):
            step()
        dist.barrier()
        times.append((time.perf_counter() - started) / steps * 1000)
    if rank == 0:
        print(" ".join(f"{t:.3f}" for t in times))
    dist.destroy_process_group()


def comm_ms(args: argparse.Namespace) -> tuple[float, float]:
    """A TP=2 decode step's collectives and a PP=2 step's hand-over alone, in ms (2
    processes, gloo)."""
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
    tp, pp = (float(x) for x in out[0].split())
    return tp, pp


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
            one, one_step = decode(model, 1, 1, args)
            tp2, tp2_step = decode(model, 2, 1, args)
            pp2, pp2_step = decode(model, 1, 2, args)
            tp_comm, pp_comm = comm_ms(args)
            rows.append((one, tp2, pp2, one_step, tp2_step, pp2_step, tp_comm, pp_comm))
            print(
                f"run {run + 1}: 1 worker {one:.0f} tok/s ({one_step:.1f} ms a step), TP=2 "
                f"{tp2:.0f} ({tp2_step:.1f} ms), PP=2 {pp2:.0f} ({pp2_step:.1f} ms); "
                f"TP=2 collectives {tp_comm:.2f} ms a step, PP=2 hand-over {pp_comm:.2f} ms",
                flush=True,
            )
    med = [statistics.median(col) for col in zip(*rows, strict=True)]
    print(
        f"median of {args.runs}: 1 worker {med[0]:.0f} tok/s, TP=2 {med[1]:.0f} "
        f"(step {med[4] / med[3]:.2f}x), PP=2 {med[2]:.0f} (step {med[5] / med[3]:.2f}x); "
        f"TP=2 collectives {med[6]:.2f} ms a step, PP=2 hand-over {med[7]:.2f} ms "
        f"(batch {args.batch}, {os.cpu_count()} cores)"
    )


if __name__ == "__main__":
    main()
