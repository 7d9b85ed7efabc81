"""The engine's side of ``--runner pooling``: what a rank says of its vectors, the defaults a
pooling request takes from ``--pooler-config``, and its finish once the runner pooled it.

A pooling request is scheduled like any prompt (chunked prefill included); the model runner
pools its hidden states in the step that completes the prompt (``engine.worker.pooler``), and
the request then finishes (``stop``) with its vector, without sampling a token (vLLM marks it
``FINISHED_STOPPED`` as soon as it has pooler output).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import msgspec

from corefleet.engine.config import EngineConfig
from corefleet.engine.messages import (
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    PoolerInfo,
    PoolingParams,
)
from corefleet.engine.pooler_config import check_dimensions, parse_pooler_config, resolve_runner
from corefleet.engine.request import Request, RequestStatus


def pooler_info(config: EngineConfig, hidden_size: int, model_path: str) -> PoolerInfo | None:
    """What a pooling rank tells its clients (None for a generating one), for a model whose
    hidden states have ``hidden_size`` values (the core does not read models). Matryoshka models
    say so in their ``config.json`` (``is_matryoshka``, ``matryoshka_dimensions``), as vLLM
    reads them; only those may shorten vectors with ``dimensions``."""
    if resolve_runner(config.model.runner) != "pooling":
        return None
    pooler = parse_pooler_config(config.model.pooler_config)
    hf_config: dict[str, object] = {}
    config_file = Path(model_path) / "config.json"
    if config_file.is_file():
        hf_config = json.loads(config_file.read_text())
    sizes = hf_config.get("matryoshka_dimensions")
    dimensions = [int(d) for d in sizes] if isinstance(sizes, list) else None
    info = PoolerInfo(
        pooling_type=pooler.pooling_type,
        use_activation=pooler.use_activation,
        hidden_size=hidden_size,
        is_matryoshka=bool(hf_config.get("is_matryoshka")) or dimensions is not None,
        matryoshka_dimensions=dimensions,
    )
    if pooler.dimensions is not None:
        check_dimensions(pooler.dimensions, info, "pooler_config.dimensions")
    return info


def prepare_pooling_request(
    request: EngineCoreRequest, info: PoolerInfo | None, default_dimensions: int | None
) -> EngineCoreRequest:
    """``request`` with its pooling parameters complete (the server's defaults for those
    unset); ``ValueError`` when the request does not fit the runner or asks for a size the
    model cannot give. A rank checks even what a coordinator checked: a wire client need not
    have gone through one."""
    params = request.pooling_params
    if info is None:
        if params is not None:
            raise ValueError("this engine generates (--runner generate): pooling is refused")
        return request
    if params is None:
        raise ValueError("this engine pools (--runner pooling): generation is refused")
    dimensions = params.dimensions if params.dimensions is not None else default_dimensions
    if dimensions is not None:
        check_dimensions(dimensions, info, "dimensions")
    resolved = PoolingParams(
        dimensions=dimensions,
        use_activation=info.use_activation
        if params.use_activation is None
        else params.use_activation,
        pooling_type=params.pooling_type or info.pooling_type,  # type: ignore[arg-type]
    )
    return msgspec.structs.replace(request, pooling_params=resolved)


def finish_pooled(
    requests: Mapping[str, Request],
    pooler_output: Mapping[str, bytes],
    outputs: dict[int, list[EngineCoreOutput]],
) -> list[Request]:
    """Finish each request the runner pooled with an output carrying its vector; returns the
    requests to remove. One finished (aborted) while the model ran gets nothing."""
    stopped: list[Request] = []
    for req_id, vector in pooler_output.items():
        request = requests.get(req_id)
        if request is None or request.is_finished:
            continue
        request.status = RequestStatus.FINISHED_STOPPED
        output = EngineCoreOutput(
            req_id,
            [],
            finish_reason=FinishReason.STOP,
            num_cached_tokens=max(0, request.num_cached_tokens),
            pooling_output=vector,
            events=request.take_events(),  # for the request-level metrics
        )
        outputs.setdefault(request.client_index, []).append(output)
        stopped.append(request)
    return stopped
