"""Offline throughput: corefleet vs Hugging Face ``generate`` on SmolLM2, in the same run.

Workload: 64 prompts of 64-512 random tokens, 64-256 output tokens each, ignore_eos, greedy,
fixed seed. The measured runs alternate between the two engines. Prints output tokens/s for
both sides, their ratio (of the medians, and per run pair), the model FLOPs utilisation
against a GEMM peak measured now (torch matmuls of the model's own shapes), and single-stream
decode tokens/s against the memory-bandwidth bound.

    python benchmarks/offline_throughput.py --dtype float32
    python benchmarks/offline_throughput.py --dtype bfloat16 --runs 3
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hf_baseline import hf_generate_batch, hf_throughput, load_hf_model
from roofline import gemm_peak_flops, memory_bandwidth

from corefleet.engine import LLM, SamplingParams
from corefleet.engine.models.arch import ArchConfig
from corefleet.engine.models.loader import load_arch_config, resolve_model_path

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def make_workload(n: int, vocab: int, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(100, vocab - 100) for _ in range(rng.randint(64, 512))] for _ in range(n)
    ]
    return prompts, [rng.randint(64, 256) for _ in range(n)]


def linear_params(a: ArchConfig) -> int:
    """Weights of every matmul a token goes through, the LM head excluded."""
    q, kv = a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim
    per_layer = (
        a.hidden_size * (q + 2 * kv) + q * a.hidden_size + 3 * a.hidden_size * a.intermediate_size
    )
    return per_layer * a.num_hidden_layers


def workload_flops(a: ArchConfig, prompts: list[list[int]], output_lens: list[int]) -> float:
    """Model FLOPs: 2 per weight per token, attention (QK^T and PV) per token and context
    position, and the LM head for each generated token."""
    dense = 2 * linear_params(a)
    attn_per_pos = 4 * a.num_hidden_layers * a.num_attention_heads * a.head_dim
    total = 0.0
    for prompt, out in zip(prompts, output_lens, strict=True):
        n_tokens = len(prompt) + out
        total += dense * n_tokens
        total += attn_per_pos * n_tokens * (n_tokens + 1) / 2
        total += 2 * a.hidden_size * a.vocab_size * out
    return total


def model_gemm_shapes(a: ArchConfig, m: int) -> list[tuple[int, int, int]]:
    q, kv = a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim
    return [
        (m, a.hidden_size, q + 2 * kv),
        (m, q, a.hidden_size),
        (m, a.hidden_size, 2 * a.intermediate_size),
        (m, a.intermediate_size, a.hidden_size),
    ]


def bench_corefleet(
    llm: LLM, prompts: list[list[int]], output_lens: list[int], runs: int
) -> list[float]:
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) for n in output_lens]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    rates = []
    for _ in range(runs):
        t0 = time.perf_counter()
        outs = llm.generate(inputs, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        generated = sum(len(o.outputs[0].token_ids) for o in outs)
        assert generated == sum(output_lens), "every request must produce its max_tokens"
        rates.append(generated / elapsed)
    return rates


def single_stream(generate_fn, new_tokens: int, runs: int) -> float:  # type: ignore[no-untyped-def]
    rates = []
    for _ in range(runs):
        t0 = time.perf_counter()
        generate_fn()
        rates.append(new_tokens / (time.perf_counter() - t0))
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument(
        "--runs", type=int, default=3, help="alternating corefleet / HF runs (medians reported)"
    )
    parser.add_argument(
        "--hf-batch-sizes",
        default="1,8,32",
        help="HF batch sizes; the last one alternates with corefleet, the others run once",
    )
    parser.add_argument(
        "--hf-batch1-prompts",
        type=int,
        default=4,
        help="batch size 1 runs on this many prompts (it is slow); a rate",
    )
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    torch.manual_seed(0)
    dtype = DTYPES[args.dtype]
    model_path = resolve_model_path(None)
    arch = load_arch_config(model_path)
    prompts, output_lens = make_workload(args.num_prompts, arch.vocab_size, seed=0)
    results: dict[str, object] = {"dtype": args.dtype, "threads": torch.get_num_threads()}

    # Both engines stay loaded and their measured runs alternate (corefleet, then Hugging Face
    # at its best batch size, `--runs` times): this machine's speed drifts by up to 2x within
    # minutes, and alternating puts both sides of each ratio in the same few minutes.
    llm = LLM(
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False,
    )
    bench_corefleet(llm, prompts[:4], [16] * 4, runs=1)  # warm-up
    model, tokenizer = load_hf_model(model_path, dtype)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batch_sizes = [int(b) for b in args.hf_batch_sizes.split(",")]
    hf_rates: dict[int, float] = {}
    for bs in batch_sizes[:-1]:  # the smaller batch sizes once each, to pick the best
        n = args.hf_batch1_prompts if bs == 1 else len(prompts)
        hf_rates[bs], _ = hf_throughput(model, prompts[:n], output_lens[:n], bs, pad_id)
        print(f"  HF batch {bs}: {hf_rates[bs]:.1f} tok/s", flush=True)
    cf_rates: list[float] = []
    hf_runs: list[float] = []
    for run in range(args.runs):
        cf_rates += bench_corefleet(llm, prompts, output_lens, runs=1)
        hf_runs.append(hf_throughput(model, prompts, output_lens, batch_sizes[-1], pad_id)[0])
        print(
            f"  run {run + 1}: corefleet {cf_rates[-1]:.1f}, HF batch "
            f"{batch_sizes[-1]} {hf_runs[-1]:.1f} tok/s",
            flush=True,
        )
    hf_rates[batch_sizes[-1]] = statistics.median(hf_runs)
    cf_rate = statistics.median(cf_rates)
    hf_best_bs = max(hf_rates, key=lambda b: hf_rates[b])
    hf_rate = hf_rates[hf_best_bs]
    pair_ratios = [c / h for c, h in zip(cf_rates, hf_runs, strict=True)]

    decode_prompt = {"prompt_token_ids": prompts[0][:32]}
    decode_params = SamplingParams(max_tokens=args.decode_tokens, ignore_eos=True, temperature=0)
    cf_decode = single_stream(
        lambda: llm.generate(decode_prompt, decode_params, use_tqdm=False),
        args.decode_tokens,
        runs=3,
    )
    llm.shutdown()
    hf_decode = single_stream(
        lambda: hf_generate_batch(model, [prompts[0][:32]], args.decode_tokens, pad_id),
        args.decode_tokens,
        runs=3,
    )

    # -- machine ceilings ---------------------------------------------------------------------
    peak = gemm_peak_flops(model_gemm_shapes(arch, 512) + model_gemm_shapes(arch, 64), dtype)
    bandwidth = memory_bandwidth()
    flops = workload_flops(arch, prompts, output_lens)
    total_out = sum(output_lens)
    weight_bytes = (linear_params(arch) + arch.hidden_size * arch.vocab_size) * torch.tensor(
        [], dtype=dtype
    ).element_size()
    decode_bound = bandwidth / weight_bytes

    results.update(
        corefleet_tok_s=cf_rate,
        corefleet_runs=cf_rates,
        hf_tok_s=hf_rate,
        hf_best_batch=hf_best_bs,
        hf_by_batch=hf_rates,
        hf_runs=hf_runs,
        ratio=cf_rate / hf_rate,
        pair_ratios=pair_ratios,
        gemm_peak_gflops=peak / 1e9,
        corefleet_mfu=flops * cf_rate / total_out / peak,
        hf_mfu=flops * hf_rate / total_out / peak,
        bandwidth_gb_s=bandwidth / 1e9,
        decode_bound_tok_s=decode_bound,
        corefleet_decode_tok_s=cf_decode,
        hf_decode_tok_s=hf_decode,
        corefleet_decode_frac=cf_decode / decode_bound,
        hf_decode_frac=hf_decode / decode_bound,
    )
    print(
        f"\nSmolLM2-135M {args.dtype}, {args.num_prompts} prompts, {total_out} output tokens, "
        f"{torch.get_num_threads()} threads"
    )
    print(f"{'':24}{'corefleet':>12}{'HF':>12}")
    print(
        f"{'output tok/s':24}{cf_rate:12.1f}{hf_rate:12.1f}   (HF best batch {hf_best_bs}; "
        f"ratio {cf_rate / hf_rate:.2f}x)"
    )
    print(
        f"{'ratio per run pair':24}{statistics.median(pair_ratios):12.2f}x"
        f"   ({', '.join(f'{r:.2f}' for r in pair_ratios)})"
    )
    print(
        f"{'MFU vs GEMM peak':24}{results['corefleet_mfu']:12.1%}{results['hf_mfu']:12.1%}"
        f"   (peak {peak / 1e9:.1f} GFLOP/s)"
    )
    print(
        f"{'decode tok/s (1 stream)':24}{cf_decode:12.1f}{hf_decode:12.1f}   "
        f"(bound {decode_bound:.1f} tok/s at {bandwidth / 1e9:.1f} GB/s)"
    )
    print(f"{'decode / bound':24}{cf_decode / decode_bound:12.1%}{hf_decode / decode_bound:12.1%}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
