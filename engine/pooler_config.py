"""``--runner`` and ``--pooler-config``: whether the engine generates tokens or pools hidden
states into vectors (embeddings), and how it pools them (vLLM's ``PoolerConfig``).

A ``*ForCausalLM`` checkpoint served with ``--runner pooling`` becomes an embedding model as
vLLM's ``--convert embed`` makes it: each request's prompt runs through the model, and the
final norm's hidden states (the inputs of ``lm_head``) are pooled into one vector: the last
token's (``LAST``, vLLM's default for decoders), their mean (``MEAN``) or the first token's
(``CLS``); then, with ``use_activation`` (the default), L2-normalised.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal, get_args

from corefleet.engine.messages import PoolerInfo, PoolingType

Runner = Literal["auto", "generate", "pooling"]

POOLING_TYPES: tuple[str, ...] = get_args(PoolingType)

# vLLM's keys this server has no use for: each is accepted only at its default value.
_DEFAULT_ONLY: dict[str, object] = {"task": "embed", "enable_chunked_processing": False}


@dataclass(frozen=True)
class PoolerConfig:
    """How a pooling runner turns a prompt's hidden states into a vector."""

    pooling_type: PoolingType = "LAST"
    use_activation: bool = True  # L2-normalise the vector
    dimensions: int | None = None  # a Matryoshka model's default vector length


def resolve_runner(runner: str) -> str:
    """``auto`` is ``generate``: every architecture the engine loads is a causal LM."""
    return "generate" if runner == "auto" else runner


def parse_pooler_config(text: str | None) -> PoolerConfig:
    """``--pooler-config`` (a JSON object) as a :class:`PoolerConfig`; ``ValueError`` names
    the bad key. ``normalize`` is the older vLLM name of ``use_activation``."""
    if text is None:
        return PoolerConfig()
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"invalid engine argument pooler_config: not JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError("invalid engine argument pooler_config: must be a JSON object")
    values = dict(raw)
    if "normalize" in values:
        values.setdefault("use_activation", values.pop("normalize"))
    for key, default in _DEFAULT_ONLY.items():
        if key in values and values.pop(key) not in (None, default):
            raise ValueError(
                f"invalid engine argument pooler_config: {key} must be {default!r} here"
            )
    unknown = sorted(set(values) - {"pooling_type", "use_activation", "dimensions"})
    if unknown:
        raise ValueError(
            f"invalid engine argument pooler_config: unsupported keys {unknown}; supported: "
            "pooling_type, use_activation (normalize), dimensions"
        )
    pooling_type = values.get("pooling_type") or "LAST"
    if not isinstance(pooling_type, str) or pooling_type.upper() not in POOLING_TYPES:
        raise ValueError(
            f"invalid engine argument pooler_config: pooling_type={pooling_type!r} must be one "
            f"of {', '.join(POOLING_TYPES)}"
        )
    use_activation = values.get("use_activation")
    if use_activation is None:
        use_activation = True
    if not isinstance(use_activation, bool):
        raise ValueError("invalid engine argument pooler_config: use_activation must be a bool")
    dimensions = values.get("dimensions")
    if dimensions is not None and (
        isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1
    ):
        raise ValueError(
            f"invalid engine argument pooler_config: dimensions={dimensions!r} must be a "
            "positive integer"
        )
    return PoolerConfig(pooling_type.upper(), use_activation, dimensions)  # type: ignore[arg-type]


def check_dimensions(dimensions: int, info: PoolerInfo, name: str = "dimensions") -> None:
    """``ValueError`` naming ``name`` unless a vector of this model may be cut to
    ``dimensions`` values (vLLM's rules: a Matryoshka model, a size it lists if it lists
    any, at most the hidden size)."""
    if not info.is_matryoshka:
        raise ValueError(
            f"invalid pooling parameter {name}={dimensions!r}: the model does not support "
            "matryoshka representation, so its embeddings cannot be shortened"
        )
    if isinstance(dimensions, bool) or not isinstance(dimensions, int):
        raise ValueError(f"invalid pooling parameter {name}={dimensions!r}: must be an integer")
    allowed = info.matryoshka_dimensions
    if allowed is not None and dimensions not in allowed:
        raise ValueError(
            f"invalid pooling parameter {name}={dimensions!r}: the model supports only "
            f"dimensions {allowed}"
        )
    if not 1 <= dimensions <= info.hidden_size:
        raise ValueError(
            f"invalid pooling parameter {name}={dimensions!r}: must be in [1, {info.hidden_size}]"
        )
