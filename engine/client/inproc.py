"""The engine in this process: :class:`InprocClient` steps an :class:`EngineCore` directly."""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from typing import Any

from corefleet.engine.client.base import EngineCoreClient
from corefleet.engine.config import EngineConfig
from corefleet.engine.engine_core.core import EngineCore
from corefleet.engine.messages import EngineCoreOutputs, EngineCoreRequest
from corefleet.engine.worker.executor import ExecutorFactory


class InprocClient(EngineCoreClient):
    """The engine in this process: ``get_output`` runs one step."""

    def __init__(self, config: EngineConfig, executor_class: ExecutorFactory | None = None) -> None:
        self.engine = EngineCore(config, executor_class)
        self.engine_info = self.engine.make_ready_response(rank=0)
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
        result = self.engine.get_utility(method)(*args)  # UnknownUtilityError: a RuntimeError
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
