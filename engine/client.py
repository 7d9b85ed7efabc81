"""Clients of one EngineCore: in this process, or in a child process over ZMQ.

``make_client(config, multiprocess, asyncio_mode)`` picks one:

============  ================  ================
..            sync              asyncio
============  ================  ================
in-process    ``InprocClient``  (none)
multiprocess  ``SyncMPClient``  ``AsyncMPClient``
============  ================  ================

(the multiprocess ones live in ``corefleet.engine.client_mp``.)

Every client speaks :class:`EngineCoreRequest` in and :class:`EngineCoreOutputs` out. When a
multiprocess engine dies, every pending and later call raises :class:`EngineDeadError`, except
``abort_requests``, which becomes a no-op.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal

from corefleet.engine import envs
from corefleet.engine.config import EngineConfig
from corefleet.engine.engine_core import EngineCore, is_utility
from corefleet.engine.models.default_model import served_model_name
from corefleet.engine.protocol import EngineCoreOutputs, EngineCoreRequest, ReadyResponse


class EngineDeadError(RuntimeError):
    """The engine process is gone (it crashed, was killed, or stopped answering)."""

    def __init__(self, reason: str = "the engine core died") -> None:
        super().__init__(f"{reason}; see the engine's log above for the root cause")
        self.reason = reason


@dataclass(frozen=True)
class MPClientOptions:
    """How a multiprocess client runs its engine process.

    ``shutdown_mode``/``shutdown_timeout_s`` are what the engine does on SIGTERM (as
    ``corefleet engine-core --shutdown-mode/--shutdown-timeout``). ``curve_keys_dir`` holds
    ``server-public``, ``server-secret``, ``client-public`` and ``client-secret`` (the layout of
    the operator's CURVE Secret); when set, every socket is encrypted and only the engine with
    the client key is admitted.
    """

    shutdown_mode: Literal["drain", "abort"] = "drain"
    shutdown_timeout_s: float = 30.0
    curve_keys_dir: str | None = None
    heartbeat_timeout_s: float | None = None  # None: COREFLEET_ENGINE_HEARTBEAT_TIMEOUT_S
    extra_env: tuple[tuple[str, str], ...] = ()  # added to the engine process's environment

    def resolved_heartbeat_timeout_s(self) -> float:
        if self.heartbeat_timeout_s is not None:
            return self.heartbeat_timeout_s
        return envs.engine_heartbeat_timeout_s()


class EngineCoreClient(ABC):
    """A synchronous client; ``engine_info`` says what the engine can serve."""

    engine_info: ReadyResponse

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        """The next outputs. Multiprocess: blocks until the engine sends some, raising
        ``TimeoutError`` after ``timeout`` seconds; in-process: runs one step."""

    @abstractmethod
    def call_utility(self, method: str, *args: Any) -> Any:
        """Call a utility method of the engine; its failure raises ``RuntimeError``."""

    @abstractmethod
    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the engine; idempotent."""


class AsyncEngineCoreClient(ABC):
    """An asyncio client (the coordinator's kind)."""

    engine_info: ReadyResponse

    @abstractmethod
    async def add_request_async(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    async def abort_requests_async(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    async def get_output_async(self) -> EngineCoreOutputs: ...

    @abstractmethod
    async def call_utility_async(self, method: str, *args: Any) -> Any: ...

    @abstractmethod
    def shutdown(self, timeout: float | None = None) -> None: ...


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


def make_client(
    config: EngineConfig,
    multiprocess: bool = True,
    asyncio_mode: bool = False,
    options: MPClientOptions | None = None,
) -> EngineCoreClient | AsyncEngineCoreClient:
    """The client for this configuration (see the module docstring's table)."""
    if not multiprocess:
        if asyncio_mode:
            raise ValueError("there is no in-process asyncio client; use multiprocess=True")
        return InprocClient(config)
    from corefleet.engine.client_mp import AsyncMPClient, SyncMPClient

    options = options or MPClientOptions()
    return AsyncMPClient(config, options) if asyncio_mode else SyncMPClient(config, options)
