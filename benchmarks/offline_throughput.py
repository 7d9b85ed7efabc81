"""Offline throughput: corefleet vs Hugging Face ``generate`` on SmolLM2, in the same run.

Workload: 64 prompts of 64-512 random tokens, 64-256 output tokens each, ignore_eos, greedy,
fixed seed. The measured runs alternate between the two engines. Prints output tokens/s for
both sides, their ratio (of the medians, and per run pair), the model FLOPs utilisation
against a GEMM peak measured now (torch matmuls of the model's own shapes), and single-stream
decode tokens/s against the memory-bandwidth bound. The machine ceilings are measured next to
the runs they divide (GEMM peak per run pair, bandwidth before each single-stream run), since
this machine's speed drifts.

corefleet runs twice side by side: with the GGUF file's weights kept in their blocks (the
default, ``--quantization auto``) and dequantized to ``--dtype`` at load (``none``); the
single-stream bound of each is over the bytes of weights it reads per token.

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
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hf_baseline import hf_generate_batch, hf_throughput, load_hf_model
from roofline import gemm_peak_flops, memory_bandwidth

from corefleet.engine import LLM, SamplingParams
from corefleet.engine.models.arch import ArchConfig
from corefleet.engine.models.gguf_metadata import open_gguf
from corefleet.engine.models.loader import load_arch_config, resolve_model_path

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
QUANTIZATIONS = ("auto", "none")  # the default (GGUF blocks) first


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


def gguf_weight_bytes(path: str) -> int:
    """Bytes of the GGUF file's matrices as stored (the tied LM head reads the embedding)."""
    return sum(int(t.n_bytes) for t in open_gguf(path).tensors if len(t.shape) == 2)


def single_stream(generate_fn: Callable[[], object], new_tokens: int) -> float:
    t0 = time.perf_counter()
    generate_fn()
    return new_tokens / (time.perf_counter() - t0)


def single_stream_vs_bandwidth(
    generate_fn: Callable[[], object], new_tokens: int, weight_bytes: int, runs: int
) -> tuple[list[float], list[float]]:
    """Single-stream decode tok/s and its fraction of the bandwidth bound, per run; each run
    measures the bandwidth just before it (the bound moves with the machine's speed)."""
    rates, fractions = [], []
    for _ in range(runs):
        bound = memory_bandwidth() / weight_bytes
        rates.append(single_stream(generate_fn, new_tokens))
        fractions.append(rates[-1] / bound)
    return rates, fractions


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
    engines = {
        quantization: LLM(
            dtype=args.dtype,
            quantization=quantization,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=False,
        )
        for quantization in QUANTIZATIONS
    }
    for engine in engines.values():
        bench_corefleet(engine, prompts[:4], [16] * 4, runs=1)  # warm-up
    model, tokenizer = load_hf_model(model_path, dtype)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batch_sizes = [int(b) for b in args.hf_batch_sizes.split(",")]
    hf_rates: dict[int, float] = {}
    for bs in batch_sizes[:-1]:  # the smaller batch sizes once each, to pick the best
        n = args.hf_batch1_prompts if bs == 1 else len(prompts)
        hf_rates[bs], _ = hf_throughput(model, prompts[:n], output_lens[:n], bs, pad_id)
        print(f"  HF batch {bs}: {hf_rates[bs]:.1f} tok/s", flush=True)
    # The GEMM peak is measured next to each run pair too, and MFU is taken per run.
    peak_shapes = model_gemm_shapes(arch, 512) + model_gemm_shapes(arch, 64)
    by_quantization: dict[str, list[float]] = {q: [] for q in QUANTIZATIONS}
    cf_rates = by_quantization[QUANTIZATIONS[0]]  # the default's figures lead
    hf_runs: list[float] = []
    peaks: list[float] = []
    for run in range(args.runs):
        for quantization, engine in engines.items():
            by_quantization[quantization] += bench_corefleet(engine, prompts, output_lens, runs=1)
        peaks.append(gemm_peak_flops(peak_shapes, dtype))
        hf_runs.append(hf_throughput(model, prompts, output_lens, batch_sizes[-1], pad_id)[0])
        print(
            f"  run {run + 1}: corefleet "
            + ", ".join(f"{q} {rates[-1]:.1f}" for q, rates in by_quantization.items())
            + f", HF batch {batch_sizes[-1]} {hf_runs[-1]:.1f} tok/s, GEMM peak "
            f"{peaks[-1] / 1e9:.1f} GFLOP/s",
            flush=True,
        )
    hf_rates[batch_sizes[-1]] = statistics.median(hf_runs)
    cf_rate = statistics.median(cf_rates)
    hf_best_bs = max(hf_rates, key=lambda b: hf_rates[b])
    hf_rate = hf_rates[hf_best_bs]
    pair_ratios = [c / h for c, h in zip(cf_rates, hf_runs, strict=True)]
    flops_per_token = workload_flops(arch, prompts, output_lens) / sum(output_lens)
    cf_mfus = [flops_per_token * r / p for r, p in zip(cf_rates, peaks, strict=True)]
    peak = statistics.median(peaks)
    hf_mfu = flops_per_token * hf_rate / peak

    # Single stream against the bandwidth bound, the bandwidth measured just before each run.
    weight_bytes = (linear_params(arch) + arch.hidden_size * arch.vocab_size) * torch.tensor(
        [], dtype=dtype
    ).element_size()
    decode_prompt = {"prompt_token_ids": prompts[0][:32]}
    decode_params = SamplingParams(max_tokens=args.decode_tokens, ignore_eos=True, temperature=0)
    decodes: dict[str, tuple[list[float], list[float]]] = {}
    for quantization, engine in engines.items():
        read = gguf_weight_bytes(model_path) if quantization == "auto" else weight_bytes
        decodes[quantization] = single_stream_vs_bandwidth(
            lambda engine=engine: engine.generate(decode_prompt, decode_params, use_tqdm=False),  # type: ignore[misc]
            args.decode_tokens,
            read,
            runs=3,
        )
        engine.shutdown()
    cf_decodes, cf_fracs = decodes[QUANTIZATIONS[0]]
    hf_decodes, hf_fracs = single_stream_vs_bandwidth(
        lambda: hf_generate_batch(model, [prompts[0][:32]], args.decode_tokens, pad_id),
        args.decode_tokens,
        weight_bytes,
        runs=3,
    )
    bounds = [r / f for r, f in zip(cf_decodes + hf_decodes, cf_fracs + hf_fracs, strict=True)]
    decode_bound = statistics.median(bounds)
    cf_decode, hf_decode = statistics.median(cf_decodes), statistics.median(hf_decodes)
    cf_frac, hf_frac = statistics.median(cf_fracs), statistics.median(hf_fracs)

    results.update(
        corefleet_by_quantization={
            q: {
                "tok_s": statistics.median(rates),
                "runs": rates,
                "decode_tok_s": decodes[q][0],
                "decode_frac": decodes[q][1],
            }
            for q, rates in by_quantization.items()
        },
        corefleet_tok_s=cf_rate,
        corefleet_runs=cf_rates,
        hf_tok_s=hf_rate,
        hf_best_batch=hf_best_bs,
        hf_by_batch=hf_rates,
        hf_runs=hf_runs,
        ratio=cf_rate / hf_rate,
        pair_ratios=pair_ratios,
        gemm_peak_gflops=[p / 1e9 for p in peaks],
        corefleet_mfu=statistics.median(cf_mfus),
        corefleet_mfu_runs=cf_mfus,
        hf_mfu=hf_mfu,
        decode_bound_tok_s=bounds,
        corefleet_decode_tok_s=cf_decodes,
        hf_decode_tok_s=hf_decodes,
        corefleet_decode_frac=cf_fracs,
        hf_decode_frac=hf_fracs,
    )
    print(
        f"\nSmolLM2-135M {args.dtype}, {args.num_prompts} prompts, {sum(output_lens)} output "
        f"tokens, {torch.get_num_threads()} threads"
    )
    print(f"{'':24}{'corefleet':>12}{'HF':>12}   (corefleet: the default, GGUF blocks)")
    print(
        f"{'output tok/s':24}{cf_rate:12.1f}{hf_rate:12.1f}   (HF best batch {hf_best_bs}; "
        f"ratio {cf_rate / hf_rate:.2f}x)"
    )
    print(
        f"{'ratio per run pair':24}{statistics.median(pair_ratios):12.2f}x"
        f"   ({', '.join(f'{r:.2f}' for r in pair_ratios)})"
    )
    print(
        f"{'MFU vs GEMM peak':24}{statistics.median(cf_mfus):12.1%}{hf_mfu:12.1%}"
        f"   (per run {', '.join(f'{m:.1%}' for m in cf_mfus)}; peak median "
        f"{peak / 1e9:.1f} GFLOP/s)"
    )
    print(
        f"{'decode tok/s (1 stream)':24}{cf_decode:12.1f}{hf_decode:12.1f}   "
        f"(bound median {decode_bound:.1f} tok/s, "
        f"{decode_bound * weight_bytes / 1e9:.1f} GB/s)"
    )
    print(
        f"{'decode / bound':24}{cf_frac:12.1%}{hf_frac:12.1%}"
        f"   (per run {', '.join(f'{f:.1%}' for f in cf_fracs)})"
    )
    print("\ncorefleet by --quantization (auto: GGUF blocks; none: dequantized to --dtype)")
    for q, rates in by_quantization.items():
        q_decodes, q_fracs = decodes[q]
        print(
            f"  {q:5} output {statistics.median(rates):7.1f} tok/s (runs "
            f"{', '.join(f'{r:.1f}' for r in rates)}); 1 stream "
            f"{statistics.median(q_decodes):6.1f} tok/s, {statistics.median(q_fracs):.1%} "
            "of its bandwidth bound"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
