"""GPU kernels and the engine's decode step against the device's memory bandwidth.

One prepared run for an H200 (any CUDA GPU works), three parts, every figure against the peak
bandwidth measured in the same run (a large device-to-device copy, read + write counted):

1. The Triton paged-attention kernel on decode batches of an 8B-shaped layer (32 query heads,
   8 KV heads of 128, bfloat16, blocks of 16): batch 1/16/64/256 at context 1k and 4k. Achieved
   bandwidth = K/V bytes of every context (+ queries and outputs) / kernel time.
2. flash-attn's varlen paged kernel on the same batches (blocks of 256 tokens, its minimum),
   when flash_attn is installed.
3. The engine's decode step (scheduler + batch preparation + forward + sampling) for an
   8B-shaped Llama with random weights, batch 64 at context 1024, as a fraction of the HBM
   roofline: (weights read per step + KV bytes per step) / peak bandwidth.
4. The Triton GGUF matmul (weights kept in their blocks) against torch's bfloat16 matmul on the
   dequantized weight, every format, weights [N, K] of 4096 x 4096 and 4096 x 14336, at
   M = 1, 16 and 256 rows of x. Bandwidth = the weight's bytes (quantized or bfloat16) / time.

Targets: attention >= 80 % of peak at batch >= 64; engine step >= 75 % of roofline.

    python benchmarks/kernels_gpu.py [--backend triton|flash-attn] [--json out.json]
        [--part all|attention|engine|gguf]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time

import numpy as np
import torch

if not torch.cuda.is_available():
    sys.exit("kernels_gpu.py measures GPU kernels and needs a CUDA device; this machine has none.")

import triton.testing  # after the CUDA check, so that its message comes first

from corefleet.engine.config import EngineConfig
from corefleet.engine.core.block_hash import make_block_hasher
from corefleet.engine.core.scheduler import Scheduler
from corefleet.engine.messages import SamplingParams
from corefleet.engine.models.arch import ArchConfig
from corefleet.engine.request import Request
from corefleet.engine.worker.model_runner import ModelRunner
from corefleet.kernels import flash_attn, gguf_quant
from corefleet.kernels.triton_ops import attention as triton_attention
from corefleet.kernels.triton_ops import gguf_matmul
from tests.gguf_blocks import random_qweight

DEVICE = torch.device("cuda")
DTYPE = torch.bfloat16
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
LLAMA_8B = ArchConfig(  # Llama-3-8B's shape; weights are random, nothing is downloaded
    architecture="LlamaForCausalLM",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=NUM_Q_HEADS,
    num_key_value_heads=NUM_KV_HEADS,
    head_dim=HEAD_DIM,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    max_position_embeddings=8192,
    tie_word_embeddings=False,
)


def peak_bandwidth(num_bytes: int = 4 << 30) -> float:
    """Bytes/s of a device-to-device copy (read + write counted), median of 10."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=200, return_mode="median")
    return 2 * num_bytes / (ms * 1e-3)


def _decode_batch(batch: int, context: int, block_size: int) -> dict[str, torch.Tensor]:
    """A decode step's inputs: each row's ``context`` tokens in shuffled cache blocks."""
    blocks_per_row = -(-context // block_size)
    num_blocks = 1 + batch * blocks_per_row
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    ids = torch.randperm(num_blocks - 1, device=DEVICE, dtype=torch.int32) + 1
    return {
        "query": torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE),
        "k_cache": torch.randn(shape, device=DEVICE, dtype=DTYPE),
        "v_cache": torch.randn(shape, device=DEVICE, dtype=DTYPE),
        "block_tables": ids.view(batch, blocks_per_row),  # [B, nb] int32
        "seq_lens": torch.full((batch,), context, device=DEVICE, dtype=torch.int32),
        "query_start_loc": torch.arange(batch + 1, device=DEVICE, dtype=torch.int32),
    }


def _attention_bytes(batch: int, context: int) -> int:
    kv = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize
    return kv + 2 * batch * NUM_Q_HEADS * HEAD_DIM * DTYPE.itemsize  # + queries and outputs


def bench_triton_decode(batch: int, context: int) -> float:
    """Milliseconds of one Triton unified-attention launch on a decode batch."""
    x = _decode_batch(batch, context, 16)
    return triton.testing.do_bench(
        lambda: triton_attention.unified_attention(
            x["query"],
            x["k_cache"],
            x["v_cache"],
            x["block_tables"],
            x["seq_lens"],
            x["query_start_loc"],
            1,
            context,
            HEAD_DIM**-0.5,
        ),
        warmup=25,
        rep=200,
        return_mode="median",
    )


def bench_flash_attn_decode(batch: int, context: int) -> float:
    """Milliseconds of one flash_attn_varlen_func call (paged, blocks of 256) on the batch."""
    from flash_attn import flash_attn_varlen_func

    x = _decode_batch(batch, context, flash_attn.FLASH_ATTN_PAGE_MULTIPLE)
    cu_k = torch.arange(batch + 1, device=DEVICE, dtype=torch.int32) * context
    return triton.testing.do_bench(
        lambda: flash_attn_varlen_func(
            x["query"],
            x["k_cache"],
            x["v_cache"],
            cu_seqlens_q=x["query_start_loc"],
            cu_seqlens_k=cu_k,
            max_seqlen_q=1,
            max_seqlen_k=context,
            softmax_scale=HEAD_DIM**-0.5,
            causal=True,
            block_table=x["block_tables"],
        ),
        warmup=25,
        rep=200,
        return_mode="median",
    )


class RandomWeightsRunner(ModelRunner):
    """The engine's model runner with random weights of the architecture instead of a load."""

    def load_model(self) -> None:
        from corefleet.engine.models.llama import LlamaForCausalLM
        from corefleet.engine.worker.model_runner import _cos_sin

        with torch.device("meta"):
            model = LlamaForCausalLM(self.arch, self.backend, self.max_model_len)
        model = model.to_empty(device=self.device).to(self.dtype)
        model.register_buffer(
            "cos_sin_cache", _cos_sin(self.arch, self.max_model_len, self.device), persistent=False
        )
        gen = torch.Generator(self.device).manual_seed(0)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.data.fill_(1.0)
            else:
                param.data.normal_(0.0, 0.02, generator=gen)
        self.model = model.eval()


def engine_decode_step(backend: str, batch: int, context: int, steps: int) -> dict[str, float]:
    """Median seconds of the engine's decode step, and the bytes it must read per step."""
    block_size = 256 if backend == "flash-attn" else 16
    max_len = context + steps + 32
    num_blocks = 1 + batch * -(-max_len // block_size)
    config = EngineConfig.from_kwargs(
        max_model_len=max_len,
        max_num_seqs=batch,
        max_num_batched_tokens=8192,
        num_blocks_override=num_blocks,
        block_size=block_size,
        dtype="bfloat16",
        device="cuda",
        attention_backend=backend,
        enable_prefix_caching=False,
    )
    runner = RandomWeightsRunner(config, LLAMA_8B, "", DEVICE, DTYPE)
    runner.load_model()
    runner.initialize_kv_cache(num_blocks)
    scheduler = Scheduler(config.scheduler, config.cache, num_blocks, max_len, block_size)
    hasher = make_block_hasher(block_size)
    params = SamplingParams(max_tokens=steps + 16, ignore_eos=True, temperature=0.0)
    rng = np.random.default_rng(0)
    for i in range(batch):  # prompts of context - 1 tokens: decoding runs at ~context
        prompt = rng.integers(100, LLAMA_8B.vocab_size - 100, context - 1).tolist()
        scheduler.add_request(Request(f"r{i}", prompt, params, 2, block_hasher=hasher))
    while (
        any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running)
        or (scheduler.get_request_counts()[1])
    ):
        so = scheduler.schedule()
        scheduler.update_from_output(so, runner.execute_model(so))
    times = []
    for _ in range(steps):  # execute_model ends in the sampled tokens' .tolist(): a sync
        t0 = time.perf_counter()
        so = scheduler.schedule()
        scheduler.update_from_output(so, runner.execute_model(so))
        times.append(time.perf_counter() - t0)
    assert runner.model is not None
    weights = sum(
        p.numel() * p.element_size()
        for name, p in runner.model.named_parameters()
        if name != "embed_tokens.weight"  # an embedding step reads only the batch's rows
    )
    kv = batch * context * 2 * LLAMA_8B.num_hidden_layers * NUM_KV_HEADS * HEAD_DIM * 2
    return {"step_s": statistics.median(times), "weight_bytes": weights, "kv_bytes": kv}


GGUF_SHAPES = [(4096, 4096), (4096, 14336)]  # weight [N, K]: a square projection, down_proj
GGUF_ROWS = (1, 16, 256)  # decode, a decode batch, a prefill chunk


def bench_gguf(fmt: gguf_quant.QuantFormat, n: int, k: int) -> list[dict[str, float]]:
    """Per M: milliseconds of ``gguf_linear`` and of a bfloat16 ``F.linear`` on the same values."""
    qweight = torch.from_numpy(random_qweight(fmt, n, k)).to(DEVICE)  # [N, row bytes] uint8
    weight = gguf_quant.dequantize(qweight, fmt, k).to(DTYPE)  # [N, K]
    rows = []
    for m in GGUF_ROWS:
        x = torch.randn(m, k, device=DEVICE, dtype=DTYPE)
        quant = functools.partial(gguf_matmul.gguf_linear, x, qweight, fmt)
        bf16 = functools.partial(torch.nn.functional.linear, x, weight)
        # A wrong kernel can be fast: check it against the bfloat16 matmul first.
        expected = bf16()
        error = (quant() - expected).abs().max()
        assert error <= 2e-2 * expected.abs().max(), f"{fmt.name} M={m}: off by {error}"
        quant_ms = triton.testing.do_bench(quant, return_mode="median")
        bf16_ms = triton.testing.do_bench(bf16, return_mode="median")
        rows.append({"m": m, "quant_ms": quant_ms, "bf16_ms": bf16_ms})
    return rows


def report_gguf(peak: float) -> list[dict[str, object]]:
    """Part 4: every format and shape, printed and returned."""
    print("gguf  N x K          M   quant ms  bf16 ms  speed-up  quant of peak  bf16 of peak")
    results: list[dict[str, object]] = []
    for fmt in gguf_quant.FORMATS.values():
        for n, k in GGUF_SHAPES:
            quant_bytes, bf16_bytes = n * fmt.row_bytes(k), n * k * DTYPE.itemsize
            for row in bench_gguf(fmt, n, k):
                quant_bw = quant_bytes / (row["quant_ms"] * 1e-3) / peak
                bf16_bw = bf16_bytes / (row["bf16_ms"] * 1e-3) / peak
                print(
                    f"{fmt.name}  {n:5d} x {k:5d} {row['m']:4d} {row['quant_ms']:10.4f} "
                    f"{row['bf16_ms']:8.4f} {row['bf16_ms'] / row['quant_ms']:8.2f}x "
                    f"{quant_bw:13.1%} {bf16_bw:13.1%}"
                )
                results.append({"format": fmt.name, "n": n, "k": k} | row)
            torch.cuda.empty_cache()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="triton", choices=["triton", "flash-attn"])
    parser.add_argument("--steps", type=int, default=32, help="timed engine decode steps")
    parser.add_argument("--part", default="all", choices=["all", "attention", "engine", "gguf"])
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    name = torch.cuda.get_device_name(DEVICE)
    peak = peak_bandwidth()
    print(f"{name}: peak (device copy, read + write) {peak / 1e12:.2f} TB/s")
    results: dict[str, object] = {"device": name, "peak_bytes_per_s": peak, "attention": []}
    if args.part in ("all", "attention"):
        kernels = [("triton", bench_triton_decode)]
        if flash_attn.flash_attn_installed():
            kernels.append(("flash-attn", bench_flash_attn_decode))
        else:
            print("flash-attn: not installed, skipped")
        print("kernel      batch  context    time ms    TB/s  of peak")
        for kernel, bench in kernels:
            for context in (1024, 4096):
                for batch in (1, 16, 64, 256):
                    ms = bench(batch, context)
                    rate = _attention_bytes(batch, context) / (ms * 1e-3)
                    print(
                        f"{kernel:10s} {batch:6d} {context:8d} {ms:10.4f} {rate / 1e12:7.2f} "
                        f"{rate / peak:8.1%}"
                    )
                    row = {"kernel": kernel, "batch": batch, "context": context, "ms": ms}
                    results["attention"].append(row | {"of_peak": rate / peak})  # type: ignore[attr-defined]
                    torch.cuda.empty_cache()
    if args.part in ("all", "engine"):
        step = engine_decode_step(args.backend, 64, 1024, args.steps)
        roofline_s = (step["weight_bytes"] + step["kv_bytes"]) / peak
        print(
            f"engine decode step ({args.backend}, 8B-shaped, batch 64, context 1024): "
            f"{step['step_s'] * 1e3:.2f} ms; roofline {roofline_s * 1e3:.2f} ms "
            f"({step['weight_bytes'] / 1e9:.1f} GB weights + {step['kv_bytes'] / 1e9:.1f} GB KV); "
            f"{roofline_s / step['step_s']:.1%} of roofline"
        )
        results["engine"] = step | {"roofline_s": roofline_s, "backend": args.backend}
    if args.part in ("all", "gguf"):
        results["gguf"] = report_gguf(peak)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
