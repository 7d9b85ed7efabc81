"""DPEngineCoreProc: one rank of an MoE group, stepping in data-parallel waves with its peers.

Chosen by :func:`engine_class_for` when the model is a mixture of experts and
``--data-parallel-size`` is above 1 (as vLLM's ``DPEngineCoreProc``); ranks of any other model
stay independent ``EngineCoreProc``\\ s. The group (``worker/dp_group.py``) forms once a
coordinator has answered and before the model loads; the wave state is ``waves.py``'s.

The busy loop, per vLLM: process the input; step; if nothing ran and this rank has requests or
the wave runs, run a dummy batch (the peers' collectives need this rank's forward pass); every
``SYNC_INTERVAL`` steps all-reduce :class:`~corefleet.engine.engine_core.waves.GroupSync`; when
no rank has unfinished requests every rank ends the wave there, rank 0 tells the coordinators
(``wave_complete``) and the ranks block on their input again. An ADD or a START_DP_WAVE wakes a
rank; a rank woken by an ADD asks every coordinator to wake the others (``start_wave``).

Shutdown: a draining rank (SIGTERM, drain mode) refuses new requests and keeps stepping, dummy
batches included, so the group keeps reaching its syncs; the syncs tell every rank that one
drains, and each then drains too (a rank may not leave while its peers need it in a
collective). When a sync finds no unfinished request anywhere and some rank draining, every
rank leaves at that same sync and exits 0. A rank whose group is lost (a peer died, hung or
restarted: the collective fails, or the watcher says so) exits 1 like any fatal error; the
group then forms again from new processes.
"""

from __future__ import annotations

import logging
from typing import Any

from corefleet.engine.config import EngineConfig
from corefleet.engine.engine_core.health import HealthServer
from corefleet.engine.engine_core.io_threads import STATS_NOW, EngineSignal
from corefleet.engine.engine_core.links import EVERY_COORDINATOR
from corefleet.engine.engine_core.proc import EngineCoreProc, ShutdownState
from corefleet.engine.engine_core.proc_config import EngineProcConfig
from corefleet.engine.engine_core.startup import StartupClock
from corefleet.engine.engine_core.waves import GroupSync, WaveState
from corefleet.engine.messages import EngineCoreOutputs, EngineStats, ReadyResponse, RequestType
from corefleet.engine.models.loader import load_arch_config, resolve_model_path
from corefleet.engine.worker.dp_group import DPGroup, form_dp_group

logger = logging.getLogger(__name__)


def engine_class_for(config: EngineConfig, proc_config: EngineProcConfig) -> type[EngineCoreProc]:
    """:class:`DPEngineCoreProc` for an MoE model with a data-parallel size above 1, else
    :class:`EngineCoreProc`.

    Raises:
        ValueError: an MoE group with tensor or pipeline parallelism (not supported yet: the
            group lives in the engine process, which runs the model itself only without them).
    """
    size = proc_config.data_parallel.size
    if size == 1:
        return EngineCoreProc
    arch = load_arch_config(resolve_model_path(config.model.model))
    if not arch.is_moe:
        logger.info(
            "rank %d: the model is not a mixture of experts, so --data-parallel-size %d forms "
            "no group: this rank serves on its own (as in vLLM)",
            proc_config.rank,
            size,
        )
        return EngineCoreProc
    if config.parallel.world_size > 1:
        raise ValueError(
            f"invalid engine arguments: an MoE group (--data-parallel-size {size}) needs "
            "--tensor-parallel-size 1 and --pipeline-parallel-size 1 for now (the group lives "
            "in the engine process, which runs the model itself only without them)"
        )
    return DPEngineCoreProc


class DPEngineCoreProc(EngineCoreProc):
    """An EngineCoreProc that is rank ``rank`` of an MoE group of ``data_parallel.size``."""

    def __init__(
        self,
        config: EngineConfig,
        proc_config: EngineProcConfig,
        health: HealthServer | None = None,
        clock: StartupClock | None = None,
    ) -> None:
        # Before the links open: their output threads read these for the stats at once.
        self.waves = WaveState(proc_config.rank)
        self.forward_steps = 0  # real and dummy: equal on every rank at the end of a wave
        self.dummy_steps = 0
        self.group: DPGroup | None = None
        self._leaving = False  # the group agreed to stop at the last sync
        super().__init__(config, proc_config, health, clock)

    def _before_model_load(self) -> None:
        self.group = form_dp_group(self.rank, self.proc_config.data_parallel)
        self.group.watch(self._on_group_lost)

    def _on_group_lost(self, reason: str) -> None:
        # Fatal: the busy loop raises it (ENGINE_CORE_DEAD, exit 1), the group forms again.
        self.input_queue.put_nowait((EngineSignal.EXECUTOR_FAILED, reason))

    # ---- the busy loop ---------------------------------------------------------------------

    def _idle(self) -> bool:
        return not self.waves.running and super()._idle()

    def _handle_client_request(self, kind: RequestType | EngineSignal, payload: Any) -> None:
        if kind is RequestType.START_DP_WAVE:
            self.waves.on_start(payload)
            return
        if kind is RequestType.ADD:
            # Even a request this rank refuses starts the wave: a coordinator may have woken
            # the peers for it, and they would wait for this rank at the sync.
            self._announce(self.waves.on_request(payload.request_wave))
        super()._handle_client_request(kind, payload)

    def _announce(self, wave: int | None) -> None:
        """This rank started ``wave`` on its own: every coordinator wakes the other ranks."""
        if wave is not None:
            self.output_queue.put_nowait((EVERY_COORDINATOR, EngineCoreOutputs(start_wave=wave)))

    def _process_engine_step(self) -> None:
        outputs, executed = self.step()
        for client_index, engine_outputs in outputs.items():
            self.output_queue.put_nowait((client_index, engine_outputs))
        self.complete_idle_waiters()
        unfinished = self.scheduler.has_unfinished_requests()
        if not executed:
            if not unfinished and not self.waves.running:
                return  # the group is idle
            self.executor.execute_dummy_batch()  # the peers' forward passes need ours
            self.dummy_steps += 1
        if unfinished:
            self._announce(self.waves.start())  # never holds requests outside a wave
        self.forward_steps += 1
        if self.waves.count_step():
            self._sync(unfinished)

    def _sync(self, unfinished: bool) -> None:
        """The group's all-reduce: go on, end the wave, or (draining) leave together."""
        assert self.group is not None
        draining = self.shutdown_state is not ShutdownState.RUNNING
        mine = GroupSync(unfinished, draining, self.waves.current_wave)
        sync = GroupSync.from_flags(self.group.all_reduce_max(mine.flags()))
        if sync.draining and not draining:
            logger.info("rank %d: a peer drains, so the whole group drains", self.rank)
            self.request_shutdown()
        ended = self.waves.on_sync(sync)
        if ended is None:
            return
        if sync.draining:
            # Every rank leaves at this sync: none will need another's collective, and rank
            # 0's store may go at once, which the watchers must not take for a death.
            self._leaving = True
            self.group.stop_watching()
        if self.rank == 0:
            outputs = EngineCoreOutputs(wave_complete=ended)
            self.output_queue.put_nowait((EVERY_COORDINATOR, outputs))
        self.output_queue.put_nowait(STATS_NOW)  # "idle" now, not at the next heartbeat

    def _handle_shutdown(self) -> bool:
        has_requests = super()._handle_shutdown()
        if self.shutdown_state is ShutdownState.RUNNING:
            return True
        if self._force_abort:
            return has_requests  # the parent died: leave now; the peers' collectives fail
        if self._leaving:
            return False  # the group agreed at the last sync: every rank leaves now
        # Draining: keep stepping (dummy batches included) so the group reaches its syncs,
        # and wake the peers if the group was idle (they learn of the drain at the sync).
        self._announce(self.waves.start())
        return True

    # ---- what clients see, and the end -------------------------------------------------------

    def make_engine_stats(self) -> EngineStats:
        stats = super().make_engine_stats()
        stats.step_counter = self.forward_steps
        stats.dummy_steps = self.dummy_steps
        stats.current_wave = self.waves.current_wave
        stats.wave_running = self.waves.running
        return stats

    def make_ready_response(self, rank: int) -> ReadyResponse:
        response = super().make_ready_response(rank)
        response.dp_size = self.proc_config.data_parallel.size
        return response

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            if self.group is not None:
                self.group.close()
