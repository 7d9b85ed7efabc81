"""An MoE group's ``torch.distributed`` group: the data-parallel ranks' collectives.

The ranks of an MoE model with a data-parallel size above 1 form one gloo group, world size the
DP size, in the engine process and before the model loads, so the model's expert-parallel
layers can use it (:func:`current_dp_group`; it is also the process's default group) and the
engine can all-reduce the waves' flags (``engine_core/dp_proc.py``).

**Rendezvous.** Rank 0 hosts a ``TCPStore`` at ``--data-parallel-address`` (HOST:PORT; in a
cluster, rank 0's pod); the others connect to it, every rank registers, and once all have,
``init_process_group`` pairs them. The waits are short calls in a loop, so a signal still stops
a rank that waits for its peers, and the whole formation is bounded.

**A group lives and dies whole.** Gloo cannot replace one rank: when one dies, the others must
exit too and the group re-forms from scratch (locally ``corefleet serve`` restarts them, in a
cluster the kubelet). A collective with a killed peer fails at once (gloo sees the connection
close) and one with a hung peer after ``collective_timeout_s``; an *idle* group runs no
collective, so every rank also has a watcher thread on the store: each rank bumps a counter
there every ``heartbeat_s``, and a rank reports the group lost when a peer's counter stalls for
``peer_timeout_s``, when the store is gone (rank 0 died), or when the store is marked broken. A
restarted rank that reaches the old store (its old peers have not noticed yet) finds its own
registration from before: it marks the store broken, which the old ranks' watchers see within
a heartbeat, and tries again until the new rank 0's store answers.
"""

from __future__ import annotations

import datetime
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from corefleet.engine.config import EngineConfig
from corefleet.engine.models.expert_parallel import ExpertParallel
from corefleet.engine.worker.dp_settings import DPGroupSettings

logger = logging.getLogger(__name__)

_POLL_S = 0.05  # how often a forming rank looks for its peers
_CONNECT_TRY_S = 1.0  # one attempt to reach rank 0's store (a signal is handled in between)
_STORE_OP_S = 5.0  # a watcher's store call
_BROKEN = "broken"


class DPGroupLost(RuntimeError):
    """The group cannot go on: a peer died, hung or restarted (the rank must exit)."""


class DPGroup:
    """This rank's place in a formed group, and its collectives."""

    def __init__(self, rank: int, settings: DPGroupSettings, store: Any) -> None:
        self.rank = rank
        self.size = settings.size
        self.settings = settings
        self._store = store
        self.process_group: Any = dist.group.WORLD  # the default group: the model may use it
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._nccl: Any = None  # the model's group on CUDA (``model_group``), made on first use

    def model_group(self, device: torch.device) -> Any:
        """The group the model's collectives (the expert-parallel exchange) run in, for tensors
        on ``device``: the gloo group on the CPU; on CUDA a NCCL group of the same ranks, made
        once (every rank calls this while loading its model, so the collective creation
        matches), because gloo is a CPU transport. The waves' syncs stay on gloo, on CPU
        tensors. The CUDA branch has never run: no session has had GPUs."""
        if device.type != "cuda":
            return self.process_group
        if self._nccl is None:
            self._nccl = dist.new_group(ranks=list(range(self.size)), backend="nccl")
        return self._nccl

    def all_reduce_max(self, values: list[int]) -> list[int]:
        """The element-wise maximum of every rank's ``values`` (the same length everywhere).

        Raises:
            DPGroupLost: a peer died (at once) or did not join within the collective timeout.
        """
        tensor = torch.tensor(values, dtype=torch.int64)
        try:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.process_group)
        except RuntimeError as exc:
            raise DPGroupLost(f"the data-parallel group's all-reduce failed: {exc}") from exc
        return [int(v) for v in tensor.tolist()]

    def watch(self, on_lost: Callable[[str], None]) -> None:
        """Call ``on_lost(reason)`` (once, from a thread) when the group is lost."""
        self._watcher = threading.Thread(
            target=self._watch, args=(on_lost,), name="corefleet-dp-watch", daemon=True
        )
        self._watcher.start()

    def _watch(self, on_lost: Callable[[str], None]) -> None:
        settings = self.settings
        peers = [r for r in range(self.size) if r != self.rank]
        seen = {peer: (-1, time.monotonic()) for peer in peers}  # last count, when it moved
        try:
            client = self._store.clone()  # a connection of its own: the store is not shared
            client.set_timeout(datetime.timedelta(seconds=_STORE_OP_S))
            while not self._stop.wait(settings.heartbeat_s):
                client.add(f"beat/{self.rank}", 1)
                if client.check([_BROKEN]):
                    reason = client.get(_BROKEN).decode("utf-8", "replace")
                    raise DPGroupLost(f"the data-parallel group must form again: {reason}")
                now = time.monotonic()
                for peer in peers:
                    count = client.add(f"beat/{peer}", 0)
                    last, since = seen[peer]
                    if count != last:
                        seen[peer] = (count, now)
                    elif now - since > settings.peer_timeout_s:
                        raise DPGroupLost(
                            f"data-parallel rank {peer} is silent for {now - since:.0f} s "
                            "(dead or hung)"
                        )
        except Exception as exc:
            if self._stop.is_set():
                return  # leaving: rank 0's store may go first
            reason = (
                str(exc)
                if isinstance(exc, DPGroupLost)
                else (
                    f"lost the data-parallel group's store at {settings.address} (rank 0 gone?): "
                    f"{_first_line(exc)}"
                )
            )
            logger.error("data-parallel rank %d: %s", self.rank, reason)
            on_lost(reason)

    def stop_watching(self) -> None:
        """The group agreed to stop: a peer (rank 0's store) going now is no loss."""
        self._stop.set()

    def close(self) -> None:
        """Leave: stop the watcher, then the process group (no collective: gloo's teardown
        is local)."""
        global _current
        self.stop_watching()
        if self._watcher is not None:
            self._watcher.join(timeout=_STORE_OP_S + 1)
        if dist.is_initialized():
            dist.destroy_process_group()
        self._store = None
        if _current is self:
            _current = None


_current: DPGroup | None = None


def current_dp_group() -> DPGroup | None:
    """This process's MoE group, once formed (None: an independent rank)."""
    return _current


def expert_parallel_for(config: EngineConfig, device: torch.device) -> ExpertParallel | None:
    """This rank's share of the experts under ``--enable-expert-parallel``: its place in the
    MoE group, exchanging tokens on ``device`` (None without the flag, or without a group:
    every expert stays here)."""
    group = current_dp_group()
    if not config.parallel.enable_expert_parallel:
        return None
    if group is None:
        logger.warning(
            "--enable-expert-parallel without an MoE group (--data-parallel-size above 1 and a "
            "mixture-of-experts model): this rank holds every expert"
        )
        return None
    return ExpertParallel(group.rank, group.size, group.model_group(device))


def form_dp_group(rank: int, settings: DPGroupSettings) -> DPGroup:
    """Join (rank 0: host) the group's rendezvous and form the gloo group.

    Raises:
        TimeoutError: the other ranks did not all join within ``formation_timeout_s``.
        ValueError: ``rank`` is not below the group's size.
    """
    global _current
    if not 0 <= rank < settings.size:
        raise ValueError(
            f"--rank {rank} is not in the data-parallel group of {settings.size} ranks"
        )
    started = time.monotonic()
    deadline = started + settings.formation_timeout_s
    if rank == 0:
        # The server listens on every interface at the port, and the others reach it at the
        # address; rank 0 itself connects through loopback, so its own name (a cluster DNS
        # name, published only once its pod exists) need not resolve yet.
        store = dist.TCPStore(
            "127.0.0.1",
            settings.port,
            None,
            True,
            timeout=datetime.timedelta(seconds=settings.formation_timeout_s),
            wait_for_workers=False,
        )
        store.add("joined/0", 1)
    else:
        store = _join_fresh_store(rank, settings, deadline)
    _wait_for_everyone(store, settings, deadline)
    # gloo's own rendezvous waits on the store for its peers' addresses: a peer may reach it
    # later than this rank (it polls), so the wait is what remains of the formation's time.
    store.set_timeout(datetime.timedelta(seconds=max(1.0, deadline - time.monotonic())))
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("gloo", store),
        rank=rank,
        world_size=settings.size,
        timeout=datetime.timedelta(seconds=settings.collective_timeout_s),
    )
    store.set_timeout(datetime.timedelta(seconds=_STORE_OP_S))
    _current = DPGroup(rank, settings, store)
    logger.info(
        "data-parallel rank %d of %d: the group formed at %s in %.1f s",
        rank,
        settings.size,
        settings.address,
        time.monotonic() - started,
    )
    return _current


def _join_fresh_store(rank: int, settings: DPGroupSettings, deadline: float) -> Any:
    """Connect to rank 0's store, and register; a store where this rank registered before
    belongs to a group of an earlier process of this rank: mark it broken (its ranks then
    exit) and wait for a new one."""
    said = False
    while True:
        try:
            # A plain connect first: c10d logs every failed attempt of its own as an error.
            socket.create_connection((settings.host, settings.port), _CONNECT_TRY_S).close()
            store = dist.TCPStore(
                settings.host,
                settings.port,
                None,
                False,
                timeout=datetime.timedelta(seconds=_CONNECT_TRY_S),
            )
            if store.add(f"joined/{rank}", 1) == 1:
                return store
            store.set(_BROKEN, f"data-parallel rank {rank} started again")
            if not said:
                logger.warning(
                    "data-parallel rank %d: the store at %s holds an older group; waiting for "
                    "its ranks to exit and rank 0 to start again",
                    rank,
                    settings.address,
                )
                said = True
            del store
        except (OSError, RuntimeError) as exc:  # nobody listens yet: rank 0 is starting
            logger.debug("data-parallel rank %d: no store yet: %s", rank, _first_line(exc))
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"data-parallel rank {rank}: rank 0's store at {settings.address} did not "
                f"answer within {settings.formation_timeout_s:.0f} s"
            )
        time.sleep(_CONNECT_TRY_S)


def _wait_for_everyone(store: Any, settings: DPGroupSettings, deadline: float) -> None:
    keys = [f"joined/{r}" for r in range(settings.size)]
    while not store.check(keys):
        if time.monotonic() >= deadline:
            missing = [r for r, key in enumerate(keys) if not store.check([key])]
            raise TimeoutError(
                f"the data-parallel group did not form within {settings.formation_timeout_s:.0f}"
                f" s: ranks {missing} never joined at {settings.address}"
            )
        time.sleep(_POLL_S)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
