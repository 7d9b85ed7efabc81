"""What every engine-core client promises, whichever process the engine runs in.

:class:`EngineCoreClient` (sync) and :class:`AsyncEngineCoreClient` (asyncio) speak
:class:`EngineCoreRequest` in and :class:`EngineCoreOutputs` out. When a multiprocess engine dies,
every pending and later call raises :class:`EngineDeadError`, except ``abort_requests``, which
becomes a no-op. :class:`MPClientOptions` says how a multiprocess client runs its engine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Literal

from corefleet.engine import envs
from corefleet.engine.messages import EngineCoreOutputs, EngineCoreRequest, ReadyResponse


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
