"""The engine in this process: :class:`InprocClient` steps an :class:`EngineCore` directly."""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from typing import Any

from corefleet.engine.client.base import EngineCoreClient
from corefleet.engine.config import EngineConfig
from corefleet.engine.engine_core.core import EngineCore, is_utility
from corefleet.engine.messages import EngineCoreOutputs, EngineCoreRequest, ReadyResponse
from corefleet.engine.models.default_model import served_model_name


class InprocClient(EngineCoreClient):
    """The engine in this process: ``get_output`` runs one step."""

    def __init__(self, config: EngineConfig, executor_class: type | None = None) -> None:
        self.engine = EngineCore(config, executor_class)
        self.engine_info = ReadyResponse(
            rank=0,
            max_model_len=self.engine.max_model_len,
            num_gpu_blocks=self.engine.num_blocks,
            block_size=config.cache.block_size,
            kv_cache_size_tokens=(self.engine.num_blocks - 1) * config.cache.block_size,
            vocab_size=self.engine.vocab_size,
            model_name=served_model_name(
                config.model.served_model_name, config.model.model, self.engine.model_path
            ),
        )
        self._buffered: deque[EngineCoreOutputs] = deque()  # stepped while a utility waited

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine.abort_requests(request_ids)

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        if self._buffered:
            return self._buffered.popleft()
        outputs, _ = self.engine.step()
        self.engine.complete_idle_waiters()
        return outputs.get(0) or EngineCoreOutputs()

    def call_utility(self, method: str, *args: Any) -> Any:
        target = None if method.startswith("_") else getattr(self.engine, method, None)
        if not is_utility(target):
            raise RuntimeError(f"unknown utility method {method!r}")
        assert target is not None
        result = target(*args)
        if isinstance(result, Future):
            while not result.done():  # nobody else steps this engine: step until it resolves
                outputs, _ = self.engine.step()
                if 0 in outputs:
                    self._buffered.append(outputs[0])
                self.engine.complete_idle_waiters()
            return result.result()
        return result

    def shutdown(self, timeout: float | None = None) -> None:
        self.engine.shutdown()
