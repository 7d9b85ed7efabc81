"""The InferenceEngine spec as frozen dataclasses, parsed from the custom resource.

Called by the reconcile path (`controller.py`) before anything is built. The API server applies
the CRD's schema defaults and CEL rules, so a spec that reaches the operator is normally valid and
complete. The operator still parses defensively: the same defaults are repeated here (a unit test
checks that they equal the CRD's), because a spec may come from a server that skipped defaulting
(an old object, an emulator) and the operator never writes spec itself. Whatever is still wrong
raises `InvalidSpec`, which the handlers turn into a permanent failure with a `Degraded` reason,
never into a retry loop.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

GROUP = "corefleet.dev"
VERSION = "v1alpha1"
PLURAL = "inferenceengines"
KIND = "InferenceEngine"
API_VERSION = f"{GROUP}/{VERSION}"

DEFAULT_DRAIN_TIMEOUT_SECONDS = 30  # Drain mode without drainTimeoutSeconds (no schema default:
# a default would break the CEL rule "drainTimeoutSeconds only with Drain" for Abort specs)
ROUTING_FLAGS = {
    "LeastLoaded": "least-loaded",
    "PrefixAware": "prefix-aware",
    "RoundRobin": "round-robin",
    "PrefixHash": "prefix-hash",
}
# The coordinator's --tool-call-parser names (engine/openai/tool_parsers.py; a test holds them
# equal: the operator does not import the engine).
TOOL_CALL_PARSERS = ("hermes", "llama3_json")
MAX_RANKS = 1024  # the CRD's maximum of dataParallelSize
MAX_TENSOR_PARALLEL = 8  # a rank's workers share one node: its GPUs (the engine's bound too)
GPU_RESOURCE = "nvidia.com/gpu"
MAX_COORDINATORS = 100  # the CRD's maximum of coordinator.replicas and autoscaling bounds
VOLUME_SOURCES = ("persistentVolumeClaim", "hostPath", "nfs", "image", "csi")


class InvalidSpec(ValueError):
    """The spec cannot be turned into children; the message names the field."""


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """`spec.model`: where the weights are and how the engine should load them."""

    path: str  # absolute path inside the container
    mount_path: str = "/models"  # where `volume` is mounted (read-only)
    volume: Mapping[str, Any] | None = None  # one Kubernetes volume source, verbatim
    served_model_name: str | None = None
    dtype: str = "auto"
    quantization: str = "auto"  # auto | gguf | none
    max_model_len: int | None = None


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """`spec.engine`: scheduler and KV-cache knobs, passed to every rank as CLI flags."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    kv_cache_dtype: str = "auto"


@dataclasses.dataclass(frozen=True)
class ShutdownSpec:
    """`spec.shutdown`: what SIGTERM means for a rank."""

    mode: str = "Drain"  # Drain | Abort
    drain_timeout_seconds: int | None = None

    @property
    def effective_timeout_seconds(self) -> int:
        """Seconds a rank may spend draining (0 in Abort mode)."""
        if self.mode != "Drain":
            return 0
        return self.drain_timeout_seconds or DEFAULT_DRAIN_TIMEOUT_SECONDS


@dataclasses.dataclass(frozen=True)
class SecretKeyRef:
    """A key in a Secret of the engine's namespace."""

    name: str
    key: str = "api-key"


@dataclasses.dataclass(frozen=True)
class CoordinatorAutoscaling:
    """`spec.coordinator.autoscaling`: an HPA on the coordinators' CPU owns their count."""

    max_replicas: int
    min_replicas: int = 1
    target_cpu_utilization_percentage: int = 80


@dataclasses.dataclass(frozen=True)
class CoordinatorSpec:
    """`spec.coordinator`: the CPU-only pods that serve the API and route to ranks."""

    routing: str = "LeastLoaded"
    replicas: int = 1  # unused while `autoscaling` is set: the HPA owns the count
    autoscaling: CoordinatorAutoscaling | None = None
    service_type: str = "ClusterIP"
    service_port: int = 8000
    node_port: int | None = None
    resources: Mapping[str, Any] | None = None
    api_key_secret_ref: SecretKeyRef | None = None
    tool_call_parser: str | None = None  # set: tool_choice "auto" is served with this parser


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """The whole `spec` of one InferenceEngine, defaults resolved."""

    model: ModelSpec
    image: str
    image_pull_policy: str = "IfNotPresent"
    resources: Mapping[str, Any] | None = None
    node_selector: Mapping[str, str] | None = None
    tolerations: tuple[Mapping[str, Any], ...] = ()
    affinity: Mapping[str, Any] | None = None
    env: tuple[Mapping[str, Any], ...] = ()
    data_parallel_size: int = 1
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # The ranks form one torch.distributed group whose MoE layers split the experts: the group's
    # size is then part of every rank's command line (a scale rolls the whole group).
    enable_expert_parallel: bool = False
    engine: EngineOptions = EngineOptions()
    shutdown: ShutdownSpec = ShutdownSpec()
    coordinator: CoordinatorSpec = CoordinatorSpec()
    progress_deadline_seconds: int = 600


def _obj(raw: Any, field: str) -> Mapping[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise InvalidSpec(f"{field} must be an object")
    return raw


def _int(
    raw: Mapping[str, Any],
    key: str,
    field: str,
    default: Any,
    minimum: int,
    maximum: int | None = None,
) -> Any:
    value = raw.get(key, default)
    if value is None:
        return None
    bad = isinstance(value, bool) or not isinstance(value, int) or value < minimum
    if bad or (maximum is not None and value > maximum):
        bounds = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
        raise InvalidSpec(f"{field}.{key} must be an integer {bounds}, got {value!r}")
    return value


def _choice(raw: Mapping[str, Any], key: str, field: str, default: Any, allowed: Any) -> str:
    value = raw.get(key, default)
    if value not in allowed:
        raise InvalidSpec(f"{field}.{key} must be one of {sorted(allowed)}, got {value!r}")
    return str(value)


def _bool(raw: Mapping[str, Any], key: str, field: str, default: bool) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise InvalidSpec(f"{field}.{key} must be a boolean, got {value!r}")
    return value


def _model(raw: Mapping[str, Any]) -> ModelSpec:
    path = raw.get("path")
    if not isinstance(path, str) or not path.startswith("/"):
        raise InvalidSpec(f"spec.model.path must be an absolute path, got {path!r}")
    mount_path = raw.get("mountPath", "/models")
    volume = raw.get("volume")
    if volume is not None:
        sources = [k for k in VOLUME_SOURCES if k in _obj(volume, "spec.model.volume")]
        if len(sources) != 1:
            raise InvalidSpec(f"spec.model.volume needs exactly one of {list(VOLUME_SOURCES)}")
        if not (path == mount_path or path.startswith(mount_path.rstrip("/") + "/")):
            raise InvalidSpec("spec.model.path must lie under spec.model.mountPath")
    return ModelSpec(
        path=path,
        mount_path=mount_path,
        volume=volume,
        served_model_name=raw.get("servedModelName"),
        dtype=_choice(
            raw, "dtype", "spec.model", "auto", {"auto", "float32", "float16", "bfloat16"}
        ),
        quantization=_choice(raw, "quantization", "spec.model", "auto", {"auto", "gguf", "none"}),
        max_model_len=_int(raw, "maxModelLen", "spec.model", None, 1),
    )


def _engine(raw: Mapping[str, Any], model: ModelSpec) -> EngineOptions:
    opts = EngineOptions(
        max_num_seqs=_int(raw, "maxNumSeqs", "spec.engine", 256, 1),
        max_num_batched_tokens=_int(raw, "maxNumBatchedTokens", "spec.engine", None, 1),
        block_size=int(_choice(raw, "blockSize", "spec.engine", 16, {8, 16, 32, 64, 128})),
        gpu_memory_utilization=float(raw.get("gpuMemoryUtilization", 0.9)),
        enable_prefix_caching=_bool(raw, "enablePrefixCaching", "spec.engine", True),
        enable_chunked_prefill=_bool(raw, "enableChunkedPrefill", "spec.engine", True),
        kv_cache_dtype=_choice(
            raw,
            "kvCacheDtype",
            "spec.engine",
            "auto",
            {"auto", "float32", "float16", "bfloat16", "fp8"},
        ),
    )
    if not 0 < opts.gpu_memory_utilization <= 1:
        raise InvalidSpec("spec.engine.gpuMemoryUtilization must be in (0, 1]")
    tokens = opts.max_num_batched_tokens
    if tokens is not None and tokens < opts.max_num_seqs:
        raise InvalidSpec("spec.engine.maxNumBatchedTokens must be >= spec.engine.maxNumSeqs")
    if (
        tokens is not None
        and model.max_model_len is not None
        and not opts.enable_chunked_prefill
        and tokens < model.max_model_len
    ):
        raise InvalidSpec(
            "spec.engine.maxNumBatchedTokens must be >= spec.model.maxModelLen "
            "unless spec.engine.enableChunkedPrefill is true"
        )
    return opts


def _shutdown(raw: Mapping[str, Any]) -> ShutdownSpec:
    mode = _choice(raw, "mode", "spec.shutdown", "Drain", {"Drain", "Abort"})
    timeout = _int(raw, "drainTimeoutSeconds", "spec.shutdown", None, 1)
    if timeout is not None and mode != "Drain":
        raise InvalidSpec("spec.shutdown.drainTimeoutSeconds is only allowed with mode Drain")
    return ShutdownSpec(mode=mode, drain_timeout_seconds=timeout)


def _autoscaling(raw: Any) -> CoordinatorAutoscaling | None:
    if raw is None:
        return None
    field = "spec.coordinator.autoscaling"
    obj = _obj(raw, field)
    if "maxReplicas" not in obj:
        raise InvalidSpec(f"{field}.maxReplicas is required")
    scaling = CoordinatorAutoscaling(
        min_replicas=_int(obj, "minReplicas", field, 1, 1, MAX_COORDINATORS),
        max_replicas=_int(obj, "maxReplicas", field, None, 1, MAX_COORDINATORS),
        # Above 100 is meaningful: utilization is relative to the CPU request, and a
        # coordinator may use more than it requests when its limit allows.
        target_cpu_utilization_percentage=_int(
            obj, "targetCPUUtilizationPercentage", field, 80, 1, 1000
        ),
    )
    if scaling.min_replicas > scaling.max_replicas:
        raise InvalidSpec(f"{field}.minReplicas must be <= {field}.maxReplicas")
    return scaling


def _coordinator(raw: Mapping[str, Any]) -> CoordinatorSpec:
    service = _obj(raw.get("service"), "spec.coordinator.service")
    service_type = _choice(
        service,
        "type",
        "spec.coordinator.service",
        "ClusterIP",
        {"ClusterIP", "NodePort", "LoadBalancer"},
    )
    node_port = _int(service, "nodePort", "spec.coordinator.service", None, 1)
    if node_port is not None and service_type != "NodePort":
        raise InvalidSpec("spec.coordinator.service.nodePort is only allowed with type NodePort")
    ref_raw = raw.get("apiKeySecretRef")
    ref = None
    if ref_raw is not None:
        ref_obj = _obj(ref_raw, "spec.coordinator.apiKeySecretRef")
        if not ref_obj.get("name"):
            raise InvalidSpec("spec.coordinator.apiKeySecretRef.name is required")
        ref = SecretKeyRef(name=str(ref_obj["name"]), key=str(ref_obj.get("key", "api-key")))
    return CoordinatorSpec(
        routing=_choice(raw, "routing", "spec.coordinator", "LeastLoaded", ROUTING_FLAGS),
        replicas=_int(raw, "replicas", "spec.coordinator", 1, 1, MAX_COORDINATORS),
        autoscaling=_autoscaling(raw.get("autoscaling")),
        service_type=service_type,
        service_port=_int(service, "port", "spec.coordinator.service", 8000, 1, 65535),
        node_port=node_port,
        resources=raw.get("resources"),
        api_key_secret_ref=ref,
        tool_call_parser=_tool_call_parser(raw),
    )


def _tool_call_parser(raw: Mapping[str, Any]) -> str | None:
    if raw.get("toolCallParser") is None:
        return None
    return _choice(raw, "toolCallParser", "spec.coordinator", None, TOOL_CALL_PARSERS)


def parse_spec(spec: Mapping[str, Any]) -> EngineSpec:
    """Build an `EngineSpec` from `body['spec']`, filling the CRD's defaults.

    Raises:
        InvalidSpec: a required field is missing or a value is out of range; the message names
            the field.
    """
    image = spec.get("image")
    if not isinstance(image, str) or not image:
        raise InvalidSpec("spec.image is required")
    model = _model(_obj(spec.get("model"), "spec.model")) if "model" in spec else None
    if model is None:
        raise InvalidSpec("spec.model is required")
    tensor_parallel_size = _int(spec, "tensorParallelSize", "spec", 1, 1, MAX_TENSOR_PARALLEL)
    pipeline_parallel_size = _int(spec, "pipelineParallelSize", "spec", 1, 1, MAX_TENSOR_PARALLEL)
    devices = tensor_parallel_size * pipeline_parallel_size
    if devices > MAX_TENSOR_PARALLEL:
        raise InvalidSpec(
            f"spec.pipelineParallelSize: tensorParallelSize x pipelineParallelSize is {devices}, "
            f"more than the {MAX_TENSOR_PARALLEL} devices of one node"
        )
    _check_gpus(_obj(spec.get("resources"), "spec.resources"), devices)
    expert_parallel = _bool(spec, "enableExpertParallel", "spec", False)
    if expert_parallel and devices != 1:
        # The engine runs an MoE group's model in its own process: a rank of the group has no
        # workers to split the model over (the CRD's CEL rule says the same).
        raise InvalidSpec(
            "spec.enableExpertParallel needs tensorParallelSize x pipelineParallelSize == 1 "
            f"(got {tensor_parallel_size} x {pipeline_parallel_size}): the experts are split "
            "over the data-parallel ranks, each running the model in one process"
        )
    return EngineSpec(
        model=model,
        image=image,
        image_pull_policy=_choice(
            spec, "imagePullPolicy", "spec", "IfNotPresent", {"Always", "IfNotPresent", "Never"}
        ),
        resources=spec.get("resources"),
        node_selector=spec.get("nodeSelector"),
        tolerations=tuple(spec.get("tolerations") or ()),
        affinity=spec.get("affinity"),
        env=tuple(spec.get("env") or ()),
        data_parallel_size=_int(spec, "dataParallelSize", "spec", 1, 0, MAX_RANKS),
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
        enable_expert_parallel=expert_parallel,
        engine=_engine(_obj(spec.get("engine"), "spec.engine"), model),
        shutdown=_shutdown(_obj(spec.get("shutdown"), "spec.shutdown")),
        coordinator=_coordinator(_obj(spec.get("coordinator"), "spec.coordinator")),
        progress_deadline_seconds=_int(spec, "progressDeadlineSeconds", "spec", 600, 1),
    )


def _check_gpus(resources: Mapping[str, Any], devices: int) -> None:
    """A rank runs one worker per GPU: a GPU count that is not tensorParallelSize x
    pipelineParallelSize would start workers on GPUs the pod does not have (a crash loop), or
    leave GPUs idle."""
    for section in ("limits", "requests"):
        value = _obj(resources.get(section), f"spec.resources.{section}").get(GPU_RESOURCE)
        if value is None:
            continue
        try:
            count = int(str(value))
        except ValueError:
            count = -1
        if count != devices:
            raise InvalidSpec(
                f"spec.resources.{section}['{GPU_RESOURCE}'] is {value!r}, but the rank runs "
                f"{devices} workers (tensorParallelSize x pipelineParallelSize), one per GPU: "
                f"ask for {devices}"
            )
