"""The command lines of the rank and coordinator containers (vLLM flag names).

`corefleet engine-core --coordinator HOST:PORT --rank R ...` and `corefleet coordinator ...`,
built from the spec; the rank and the coordinator address are added by the builders
(`resources.py`, `coordinator_resources.py`).
"""

from __future__ import annotations

from corefleet.operator.naming import (
    COORDINATOR_HTTP_PORT,
    COORDINATOR_SHUTDOWN_DELAY_SECONDS,
    GRACE_MARGIN_SECONDS,
    dp_group_address,
)
from corefleet.operator.spec import ROUTING_FLAGS, EngineSpec


def engine_args(spec: EngineSpec) -> list[str]:
    """The engine-core flags every rank runs with (vLLM names; the rank comes separately).

    `--data-parallel-size` is left out on purpose: membership is dynamic, and a flag that changes
    with every `kubectl scale` would change every rank's spec hash and roll all ranks. An
    expert-parallel group is the exception: see `group_args`.
    """
    m, e, s = spec.model, spec.engine, spec.shutdown
    args = [
        "--model",
        m.path,
        "--dtype",
        m.dtype,
        "--tensor-parallel-size",
        str(spec.tensor_parallel_size),
    ]
    if spec.pipeline_parallel_size != 1:  # left out at 1: no roll of existing fleets
        args += ["--pipeline-parallel-size", str(spec.pipeline_parallel_size)]
    if m.served_model_name:
        args += ["--served-model-name", m.served_model_name]
    if m.max_model_len is not None:
        args += ["--max-model-len", str(m.max_model_len)]
    # Left out at their defaults, so that an operator upgrade does not change the ranks' spec
    # hash (and roll every fleet) for flags nobody set.
    if m.quantization != "auto":
        args += ["--quantization", m.quantization]
    if e.kv_cache_dtype != "auto":
        args += ["--kv-cache-dtype", e.kv_cache_dtype]
    args += ["--max-num-seqs", str(e.max_num_seqs)]
    if e.max_num_batched_tokens is not None:
        args += ["--max-num-batched-tokens", str(e.max_num_batched_tokens)]
    args += [
        "--block-size",
        str(e.block_size),
        "--gpu-memory-utilization",
        str(e.gpu_memory_utilization),
        "--enable-prefix-caching" if e.enable_prefix_caching else "--no-enable-prefix-caching",
        "--enable-chunked-prefill" if e.enable_chunked_prefill else "--no-enable-chunked-prefill",
        "--shutdown-mode",
        s.mode.lower(),
    ]
    if s.mode == "Drain":
        args += ["--shutdown-timeout", str(s.effective_timeout_seconds)]
    return args


def group_args(name: str, spec: EngineSpec) -> list[str]:
    """The flags that make the ranks one expert-parallel group; none for an ordinary fleet.

    The ranks of an MoE model with `enableExpertParallel` form one torch.distributed group that
    meets at rank 0's stable DNS name (`dp_group_address`) and splits the experts over its
    ranks. Unlike an ordinary fleet's membership, the group's size is part of every rank's
    identity (which experts it holds, the world size of its collectives), so
    `--data-parallel-size` is passed here on purpose: `kubectl scale` changes every rank's spec
    hash and rolls the whole group, which cannot run at two sizes at once anyway. Left out
    entirely without expert parallelism, so ordinary fleets keep their hashes (no roll).
    """
    if not spec.enable_expert_parallel:
        return []
    return [
        "--data-parallel-size",
        str(spec.data_parallel_size),
        "--data-parallel-address",
        dp_group_address(name),
        "--enable-expert-parallel",
    ]


def rank_args(name: str, spec: EngineSpec) -> list[str]:
    """Every flag of a rank but `--coordinator` and `--rank`: the engine's, then the group's."""
    return [*engine_args(spec), *group_args(name, spec)]


def coordinator_args(name: str, spec: EngineSpec) -> list[str]:
    """Flags of `corefleet coordinator` (the API key comes from the environment)."""
    args = [
        "coordinator",
        "--port",
        str(COORDINATOR_HTTP_PORT),
        "--routing",
        ROUTING_FLAGS[spec.coordinator.routing],
        "--model",
        spec.model.path,
        # Prefix-aware routing hashes prompts in the ranks' KV block size; a stopping
        # coordinator lets open streams finish within the same time a rank drains.
        "--block-size",
        str(spec.engine.block_size),
        "--shutdown-timeout",
        str(spec.shutdown.effective_timeout_seconds),
        # On SIGTERM (a rolling update, a scale-in), go on serving, not ready, while the
        # Service's endpoints drop this pod; it fits in the grace period's margin.
        "--shutdown-delay",
        str(COORDINATOR_SHUTDOWN_DELAY_SECONDS),
    ]
    if spec.model.served_model_name:
        args += ["--served-model-name", spec.model.served_model_name]
    if spec.coordinator.api_key_secret_ref is not None:
        args += ["--api-key", "$(COREFLEET_API_KEY)"]  # expanded by the kubelet from env
    if spec.coordinator.tool_call_parser is not None:
        args += [
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            spec.coordinator.tool_call_parser,
        ]
    return args


def termination_grace_seconds(spec: EngineSpec) -> int:
    """Drain timeout plus a margin: SIGKILL must never cut a drain short."""
    return spec.shutdown.effective_timeout_seconds + GRACE_MARGIN_SECONDS
