"""The engine process's entry point: signals, health endpoints, start, serve, exit code."""

from __future__ import annotations

import logging
import os
import signal
import sys
from types import FrameType

from corefleet.engine import envs
from corefleet.engine.config import EngineConfig
from corefleet.engine.engine_core.dp_proc import engine_class_for
from corefleet.engine.engine_core.health import EngineState, HealthServer
from corefleet.engine.engine_core.parent_watch import watch_parent
from corefleet.engine.engine_core.proc import EngineCoreProc
from corefleet.engine.engine_core.proc_config import EngineProcConfig
from corefleet.engine.engine_core.startup import StartupClock

logger = logging.getLogger(__name__)

# The busy loop is Python that holds the GIL between model calls; the socket threads need it
# for microseconds at a time but would wait up to the default 5 ms switch interval for it,
# which batches requests into few, late steps (see benchmarks/README.md, IPC overhead).
ENGINE_SWITCH_INTERVAL_S = 0.0005


def run_engine_core(config: EngineConfig, proc_config: EngineProcConfig) -> int:
    """The engine process: start, serve, shut down; returns the process exit code.

    SIGTERM/SIGINT while loading or waiting for INIT stop at once (exit 0); afterwards they
    start the configured shutdown. The death of the parent (``--parent-pid``/``--parent-fd``)
    aborts and exits 0 in any state. A fatal error is logged, sent to the client as
    ENGINE_CORE_DEAD, and exits 1.
    """
    clock = StartupClock()  # first: the imports before this are its first phase
    engine: EngineCoreProc | None = None

    def on_parent_death() -> bool:
        if engine is None:  # loading or waiting for INIT: nothing to abort, so exit at once
            return False
        engine.request_abort()
        return True

    # First of all: a rank must not outlive its parent, even one that dies while it loads.
    watch = watch_parent(
        proc_config.rank, proc_config.parent_pid, proc_config.parent_fd, on_parent_death
    )

    def on_signal(signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if engine is None:
            logger.info("rank %d: %s while starting; exiting", proc_config.rank, name)
            raise SystemExit(0)
        logger.info(
            "rank %d: %s received; shutting down (%s)", engine.rank, name, proc_config.shutdown_mode
        )
        engine.request_shutdown()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    sys.setswitchinterval(ENGINE_SWITCH_INTERVAL_S)
    health = None
    if proc_config.health_port:  # up before loading: liveness must hold during a long load
        try:
            health = HealthServer(
                proc_config.health_host, proc_config.health_port, proc_config.rank
            ).start()
        except OSError as exc:
            logger.error(
                "rank %d: cannot serve health endpoints on %s:%d (%s); choose another "
                "--health-port, or 0 to turn them off",
                proc_config.rank,
                proc_config.health_host,
                proc_config.health_port,
                exc,
            )
            return 2
    try:
        try:
            # An MoE model with --data-parallel-size > 1: a DPEngineCoreProc (waves).
            engine = engine_class_for(config, proc_config)(config, proc_config, health, clock)
        except Exception as exc:
            logger.exception("engine core rank %d failed to start", proc_config.rank)
            _write_termination_message(f"{type(exc).__name__}: {exc}")
            return 1
        _set_state(health, EngineState.READY)
        try:
            engine.run_busy_loop()
        except Exception as exc:
            _set_state(health, EngineState.FAILED)
            logger.exception("engine core rank %d hit a fatal error", proc_config.rank)
            engine.send_engine_dead(f"{type(exc).__name__}: {exc}")
            return 1
        _set_state(health, EngineState.STOPPED)
        logger.info("rank %d: shut down", engine.rank)
        return 0
    finally:
        if engine is not None:
            engine.shutdown()
        if health is not None:
            health.stop()
        # The exit code is decided: a late SIGTERM must not turn it into 143. It happens in
        # every clean group drain on Kubernetes: the kubelet signals each rank of an MoE group,
        # and a rank whose peer's signal came first has already drained with the group when
        # its own arrives. (Only the engine-core command calls this, and it exits next.)
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_IGN)
        if watch is not None:
            watch.exit_if_parent_gone()  # aborted for a dead client: no exit code to report


# Kubernetes keeps at most 4 KiB of a termination message.
MAX_TERMINATION_MESSAGE_BYTES = 4096


def _write_termination_message(message: str) -> None:
    """Why this rank could not start, where Kubernetes reads it (the container's
    ``lastState.terminated.message``, which the operator puts in the engine's status).
    Outside a pod the file does not exist, and nothing is written."""
    path = envs.termination_log()
    if not os.path.exists(path):
        return
    try:
        with open(path, "wb") as log:
            log.write(message.encode("utf-8", "replace")[:MAX_TERMINATION_MESSAGE_BYTES])
    except OSError as exc:
        logger.warning("cannot write the termination message to %s: %s", path, exc)


def _set_state(health: HealthServer | None, state: EngineState) -> None:
    if health is not None:
        health.state = state
