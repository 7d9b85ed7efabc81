"""CPU cost of one engine step without the model: scheduler + KV manager + batch preparation.

A null model runner does everything the real one does before and after the forward pass
(batch state updates, flattened inputs, slot mapping, attention metadata) and "samples" a fixed
token. 256 requests decode together; the figure is microseconds per step (median of runs).

    python benchmarks/step_overhead.py --num-requests 256 [--by-phase]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from corefleet.engine.config import EngineConfig
from corefleet.engine.core.block_hash import make_block_hasher
from corefleet.engine.core.scheduler import Scheduler
from corefleet.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from corefleet.engine.messages import SamplingParams
from corefleet.engine.models.arch import ArchConfig
from corefleet.engine.request import Request
from corefleet.engine.worker.model_runner import ModelRunner

SMOLLM2_SHAPE = ArchConfig(
    architecture="LlamaForCausalLM",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=1e5,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)


class NullModelRunner(ModelRunner):
    """The real batch preparation; no forward pass; every sampling request gets token 7."""

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        inputs, _meta = self.prepare_step(so)
        sampling = inputs.sample_mask
        self.batch.append_tokens(inputs.rows[sampling], np.full(int(sampling.sum()), 7))
        sampled = [[7] if s else [] for s in sampling.tolist()]
        return ModelRunnerOutput(req_ids=inputs.req_ids, sampled_token_ids=sampled)


def decoding_scheduler(
    num_requests: int, prompt_len: int, steps: int
) -> tuple[Scheduler, NullModelRunner]:
    """A scheduler and null runner with ``num_requests`` requests past their prefill."""
    config = EngineConfig.from_kwargs(
        max_model_len=4096,
        max_num_seqs=num_requests,
        max_num_batched_tokens=8192,
        num_blocks_override=20000,
    )
    runner = NullModelRunner(config, SMOLLM2_SHAPE, "", torch.device("cpu"), torch.float32)
    scheduler = Scheduler(config.scheduler, config.cache, 20000, 4096, config.cache.block_size)
    hasher = make_block_hasher(config.cache.block_size)
    params = SamplingParams(max_tokens=steps + 16, ignore_eos=True, temperature=0.0)
    for i in range(num_requests):
        prompt = [(i * 31 + j) % 40000 + 100 for j in range(prompt_len)]
        scheduler.add_request(Request(f"r{i}", prompt, params, 2, block_hasher=hasher))
    while scheduler.get_request_counts()[1] or any(  # until every request is decoding
        r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running
    ):
        so = scheduler.schedule()
        scheduler.update_from_output(so, runner.execute_model(so))
    return scheduler, runner


def run(num_requests: int, prompt_len: int, steps: int) -> float:
    """Microseconds per step, averaged over ``steps`` decode steps."""
    scheduler, runner = decoding_scheduler(num_requests, prompt_len, steps)
    t0 = time.perf_counter()
    for _ in range(steps):
        so = scheduler.schedule()
        scheduler.update_from_output(so, runner.execute_model(so))
    return (time.perf_counter() - t0) / steps * 1e6


def print_phases(num_requests: int, prompt_len: int, steps: int) -> None:
    """Median µs of each part of a step, by the first request's position in its block.

    Requests fill a block (hash, cache) or open one (allocate) only at some positions, so the
    split shows what a step costs with and without that work.
    """
    scheduler, runner = decoding_scheduler(num_requests, prompt_len, steps)
    block_size = scheduler.block_size
    times: dict[int, list[tuple[float, float, float]]] = {}
    for _ in range(steps):
        phase = scheduler.running[0].num_computed_tokens % block_size
        t0 = time.perf_counter()
        so = scheduler.schedule()
        t1 = time.perf_counter()
        out = runner.execute_model(so)
        t2 = time.perf_counter()
        scheduler.update_from_output(so, out)
        t3 = time.perf_counter()
        times.setdefault(phase, []).append((t1 - t0, t2 - t1, t3 - t2))
    print("phase  schedule  runner  update  total (µs, median)")
    for phase, parts in sorted(times.items()):
        medians = [statistics.median(p[k] for p in parts) * 1e6 for k in range(3)]
        cells = "".join(f"{m:8.0f}" for m in medians)
        print(f"{phase:5d}  {cells}{sum(medians):7.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument(
        "--by-phase", action="store_true", help="also split one run by position in the block"
    )
    args = parser.parse_args()
    figures = [run(args.num_requests, args.prompt_len, args.steps) for _ in range(args.runs)]
    print(
        f"{args.num_requests} decoding requests: {statistics.median(figures):.0f} us/step "
        f"(median of {args.runs} runs of {args.steps} steps; all: "
        f"{', '.join(f'{f:.0f}' for f in figures)})"
    )
    if args.by_phase:
        print_phases(args.num_requests, args.prompt_len, 16 * 40)


if __name__ == "__main__":
    main()
