"""The corefleet engine: EngineCore, clients, coordinator and the offline ``LLM`` API.

``from corefleet.engine import LLM, SamplingParams``. Heavy modules (torch) load on first use,
so importing the wire protocol stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from corefleet.engine.messages import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from corefleet.engine.frontend.llm import LLM
    from corefleet.engine.frontend.outputs import CompletionOutput, RequestOutput

__all__ = [
    "LLM",
    "CompletionOutput",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from corefleet.engine.frontend.llm import LLM

        return LLM
    if name in ("RequestOutput", "CompletionOutput"):
        from corefleet.engine.frontend import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'corefleet.engine' has no attribute {name!r}")
