"""The engine with and without the packed integer GGUF linear (``COREFLEET_GGUF_PACKED``), on one
GGUF file, in-process (``LLM``): single-stream decode, 32 streams, and a 2,000-token prefill.

Each measurement runs in a fresh process per setting (the variable is read when the backend is
built), settings alternating ``--pairs`` times, so a drift of a shared machine's speed does not
favour one side. Figures: single stream, 64 greedy tokens after a 32-token prompt (median of 3,
prefill included); 32 streams of 32 tokens each, aggregate tok/s; the time to the first token of
a 2,000-token prompt.

    python benchmarks/gguf_packed_engine.py "$(python benchmarks/gguf_shapes.py --shape 1b \
        --format Q4_0)"
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def measure(path: str, dtype: str) -> str:
    from corefleet.engine import LLM, SamplingParams

    llm = LLM(path, multiprocess=False, kv_cache_memory=1 << 30, max_model_len=2048, dtype=dtype)
    greedy = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(100, 132))}
    llm.generate(prompt, greedy, use_tqdm=False)  # warm-up (and the weights' packing)
    rates = []
    for _ in range(3):
        start = time.perf_counter()
        llm.generate(prompt, greedy, use_tqdm=False)
        rates.append(64 / (time.perf_counter() - start))
    batch = [{"prompt_token_ids": list(range(100 + i, 132 + i))} for i in range(32)]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(batch, params, use_tqdm=False)
    streams = 32 * 32 / (time.perf_counter() - start)
    long = {"prompt_token_ids": [100 + i % 1000 for i in range(2000)]}
    start = time.perf_counter()
    llm.generate(long, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    ttft = time.perf_counter() - start
    llm.shutdown()
    return f"{statistics.median(rates):.1f} {streams:.1f} {ttft:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a GGUF file")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(measure(args.model, args.dtype))
        return
    print("packed | single stream tok/s | 32 streams tok/s | 2000-token prefill s")
    for _ in range(args.pairs):
        for packed in ("0", "1"):
            env = {**os.environ, "COREFLEET_GGUF_PACKED": packed}
            cmd = [sys.executable, __file__, args.model, "--dtype", args.dtype, "--child"]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            single, streams, ttft = out.stdout.split()[-3:]
            print(f"{packed:6s} | {single:>19s} | {streams:>16s} | {ttft:>20s}", flush=True)


if __name__ == "__main__":
    main()
