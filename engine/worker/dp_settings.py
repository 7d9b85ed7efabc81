"""How an MoE group forms and when it is lost: settings without torch, so the ``corefleet``
command (which the coordinator process runs too) can name them."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_DP_ADDRESS = "127.0.0.1:29550"  # vLLM's data-parallel RPC port; for one machine only


@dataclass(frozen=True)
class DPGroupSettings:
    """How an MoE group forms and when it is lost (``--data-parallel-size``,
    ``--data-parallel-address``; the timeouts from ``engine/envs.py``)."""

    size: int = 1
    address: str = DEFAULT_DP_ADDRESS  # HOST:PORT of rank 0's rendezvous store
    collective_timeout_s: float = 300.0  # a collective whose peer never comes fails after it
    formation_timeout_s: float = 600.0  # every rank must have joined within it
    peer_timeout_s: float = 15.0  # a peer whose heartbeat stalls this long is lost
    heartbeat_s: float = 0.5

    def __post_init__(self) -> None:
        if not 1 <= self.size <= 1 << 16:
            raise ValueError(f"--data-parallel-size {self.size} must be between 1 and 65536")
        host, _, port = self.address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 1 << 16:
            raise ValueError(
                f"--data-parallel-address {self.address!r} must be HOST:PORT (rank 0's address)"
            )
        timeouts = (self.collective_timeout_s, self.formation_timeout_s, self.peer_timeout_s)
        if min(timeouts) <= 0 or self.heartbeat_s <= 0:
            raise ValueError("the data-parallel group's timeouts must be positive")

    @property
    def host(self) -> str:
        return self.address.rpartition(":")[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.address.rpartition(":")[2])
