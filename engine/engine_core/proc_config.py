"""How one engine process reaches its server, how it shuts down, and who its parent is."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from corefleet.engine.transport.sockets import CurveKeys
from corefleet.engine.worker.dp_settings import DPGroupSettings

ShutdownMode = Literal["drain", "abort"]


@dataclass(frozen=True)
class EngineProcConfig:
    """How one engine process reaches its server and how it shuts down.

    ``handshake_address`` is ``--coordinator``: one coordinator's handshake address, or
    several separated by commas; host names resolve to all their addresses, and the rank joins
    every coordinator it finds, resolving again every ``coordinator_refresh_s``
    (``transport/discovery.py``).

    ``parent_pid`` and ``parent_fd`` name a local parent (``corefleet serve``, a multiprocess
    client): when it dies the rank aborts and exits (``engine_core/parent_watch.py``).

    ``data_parallel`` (``--data-parallel-size``, ``--data-parallel-address``): with an MoE model
    and a size above 1, ranks 0 .. size - 1 form one group that steps in waves
    (``dp_proc.py``); any other model ignores it (independent ranks, as in vLLM).
    """

    handshake_address: str
    rank: int = 0
    shutdown_mode: ShutdownMode = "drain"
    shutdown_timeout_s: float = 30.0
    curve: CurveKeys | None = None
    pod_name: str | None = None
    parent_pid: int | None = None  # abort and exit when this process stops being our parent
    parent_fd: int | None = None  # read end of a pipe only the parent writes to: EOF = it died
    stats_interval_s: float = 0.5
    coordinator_refresh_s: float = 2.0
    health_host: str = "0.0.0.0"
    health_port: int = 0  # 0: no health endpoints (a rank pod uses 8001)
    data_parallel: DPGroupSettings = field(default_factory=DPGroupSettings)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < 1 << 16:
            raise ValueError(f"rank {self.rank} must be in [0, 65535]")
        if self.shutdown_mode not in ("drain", "abort"):
            raise ValueError(f"shutdown mode {self.shutdown_mode!r} must be drain or abort")
        if not self.coordinator_refresh_s > 0:
            raise ValueError("the coordinator refresh interval must be > 0 seconds")
        if self.shutdown_timeout_s < 0:
            raise ValueError("the shutdown timeout must be >= 0 seconds")
        if self.parent_fd is not None and self.parent_fd < 0:
            raise ValueError(f"the parent fd {self.parent_fd} must be >= 0")
