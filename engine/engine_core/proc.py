"""EngineCoreProc: an EngineCore in its own process, served over ZMQ.

The busy loop (this module) owns the engine; per coordinator, an input and an output thread
(``io_threads``, ``links``) own the sockets, and a joiner thread joins new coordinators. The
busy loop blocks on the input queue only while idle, so an idle engine costs nothing and a busy
one never waits on a socket.

Shutdown (SIGTERM/SIGINT): the handler only records the request and wakes the loop. In ``drain``
mode the engine reports ``draining`` at once, refuses new requests with finish reason
``rejected``, keeps stepping until idle or the timeout, then aborts the rest; in ``abort`` mode it
finishes every request with ``abort`` at once. Then the process exits 0. A dead parent
(``parent_watch``) shuts down as ``abort`` does, whatever the mode. A fatal error sends
``ENGINE_CORE_DEAD`` before the process exits non-zero.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any

import zmq

from corefleet.engine.config import EngineConfig
from corefleet.engine.engine_core.core import EngineCore, UnknownUtilityError
from corefleet.engine.engine_core.health import EngineState, HealthServer
from corefleet.engine.engine_core.io_threads import (
    STATS_NOW,
    DeadNotice,
    EngineSignal,
    InputItem,
    error_outputs,
)
from corefleet.engine.engine_core.links import CoordinatorLinks, Joiner, LinkSettings
from corefleet.engine.engine_core.proc_config import EngineProcConfig
from corefleet.engine.engine_core.startup import StartupClock
from corefleet.engine.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineStats,
    FinishReason,
    Refused,
    RequestType,
    UtilityCall,
    UtilityOutput,
)
from corefleet.engine.request import Request, RequestStatus
from corefleet.engine.transport.dialer import HandshakeDialer, wait_for_first_init
from corefleet.engine.transport.discovery import CoordinatorResolver
from corefleet.engine.transport.handshake import own_hello

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.2
SHUTTING_DOWN_MESSAGE = "the engine is shutting down"


class ShutdownState(enum.Enum):
    RUNNING = 0
    REQUESTED = 1  # a signal arrived; the loop has not reacted yet
    SHUTTING_DOWN = 2  # draining (or aborted); the loop exits once idle


class EngineCoreProc(EngineCore):
    """An EngineCore that serves one client over ZMQ until it is told to stop."""

    def __init__(
        self,
        config: EngineConfig,
        proc_config: EngineProcConfig,
        health: HealthServer | None = None,
        clock: StartupClock | None = None,
    ) -> None:
        clock = clock or StartupClock()
        self.proc_config = proc_config
        self.health = health
        self.rank = proc_config.rank
        self.input_queue: queue.SimpleQueue[InputItem] = queue.SimpleQueue()
        self.shutdown_state = ShutdownState.RUNNING
        self._force_abort = False
        self._exiting = False  # set by shutdown(): the last stats say the rank has left
        self._drain_deadline: float | None = None
        self._wake = threading.Event()
        self.ctx: zmq.Context = zmq.Context()

        # One link per coordinator (``links.py``): the outputs go out through its router.
        self.links = CoordinatorLinks(
            self.ctx,
            self,
            LinkSettings(
                self.rank,
                proc_config.curve,
                lambda: self.make_ready_response(self.rank),
                self.make_engine_stats,
                proc_config.stats_interval_s,
            ),
        )
        self.output_queue = self.links.router
        resolver = CoordinatorResolver(proc_config.handshake_address)
        hello = own_hello(self.rank, config.compute_hash(), proc_config.pod_name)
        dialer = HandshakeDialer(self.ctx, hello, proc_config.curve)
        first = wait_for_first_init(dialer, resolver.resolve)
        clock.phase("handshake")
        self._before_model_load()
        super().__init__(config, clock=clock)  # load the model, allocate the KV cache
        self.executor.register_failure_callback(self._on_executor_failure)
        self._waker = threading.Thread(target=self._forward_wakeups, name="corefleet-wake")
        self._waker.daemon = True
        self._waker.start()
        for reply in first:
            assert reply.sock is not None and not isinstance(reply.message, Refused)
            self.links.open(reply.address, reply.sock, reply.message)
        # The HELLOs still pending and every coordinator found later: the joiner's.
        self.joiner = Joiner(self.links, dialer, resolver, proc_config.coordinator_refresh_s)
        self.joiner.start()
        clock.phase("ready")
        clock.report(self.rank)

    def _before_model_load(self) -> None:
        """What a subclass must do once a coordinator answered and before the model loads
        (an MoE group forms here: ``dp_proc.py``)."""

    # ---- the busy loop ---------------------------------------------------------------------

    def run_busy_loop(self) -> None:
        """Serve until shut down and idle; a fatal error propagates to the caller."""
        while self._handle_shutdown():
            # 1. Client requests: block for one while idle, then take all that are queued.
            self._process_input_queue()
            # 2. One step; its outputs go to the output thread.
            self._process_engine_step()

    def _idle(self) -> bool:
        """Whether the loop has nothing to do but wait for input."""
        return not self.scheduler.has_requests() and self.shutdown_state is ShutdownState.RUNNING

    def _process_input_queue(self) -> None:
        while self._idle():
            self.complete_idle_waiters()
            if self.input_queue.empty():
                _discard(self.aborts_queue)  # every abort also came through the input queue
            try:
                # Timed: the kernel may deliver SIGTERM to another thread (ZMQ's, OpenMP's),
                # which does not interrupt this wait; the handler then runs within the timeout.
                item = self.input_queue.get(timeout=_IDLE_WAIT_S)
            except queue.Empty:
                continue
            self._handle_client_request(*item)
        while True:
            try:
                item = self.input_queue.get_nowait()
            except queue.Empty:
                return
            self._handle_client_request(*item)

    def _process_engine_step(self) -> None:
        outputs, executed = self.step()
        for client_index, engine_outputs in outputs.items():
            self.output_queue.put_nowait((client_index, engine_outputs))
        self.complete_idle_waiters()
        if not executed and self.scheduler.has_unfinished_requests():
            time.sleep(0.001)  # nothing could run: do not spin on the GIL

    def _handle_client_request(self, kind: RequestType | EngineSignal, payload: Any) -> None:
        if kind is RequestType.ADD:
            self._add(payload)
        elif kind is RequestType.ABORT:
            self.abort_requests(payload)
        elif kind is RequestType.UTILITY:
            self._call_utility(payload)
        elif kind is EngineSignal.EXECUTOR_FAILED:
            raise RuntimeError(payload or "the model executor failed")
        elif kind is EngineSignal.COORDINATOR_LOST:
            self._coordinator_lost(payload)
        # EngineSignal.WAKEUP: nothing to do; it only unblocked the loop.

    def _add(self, request: Request) -> None:
        if self.shutdown_state is not ShutdownState.RUNNING:
            message = f"rejected: {SHUTTING_DOWN_MESSAGE}"
            self.output_queue.put_nowait(error_outputs(request, FinishReason.REJECTED, message))
            return
        try:
            self.add_request(request)
        except ValueError as exc:  # e.g. a duplicate request id: that request fails, not us
            self.output_queue.put_nowait(error_outputs(request, FinishReason.ERROR, str(exc)))

    # ---- utilities -------------------------------------------------------------------------

    def _call_utility(self, call: UtilityCall) -> None:
        """Run ``call`` and queue its reply; a returned Future defers the reply until done."""

        def reply(result: Any = None, failure: str | None = None) -> None:
            output = UtilityOutput(call.call_id, failure_message=failure, result=result)
            message = EngineCoreOutputs(utility_output=output)
            self.output_queue.put_nowait((call.client_index, message))

        if self.shutdown_state is not ShutdownState.RUNNING:
            reply(failure=f"call to {call.method} refused: {SHUTTING_DOWN_MESSAGE}")
            return
        try:
            method = self.get_utility(call.method)
        except UnknownUtilityError as exc:
            reply(failure=str(exc))
            return
        try:
            result = method(*call.args)
        except Exception as exc:
            reply(failure=f"call to {call.method} failed: {exc}")
            return
        if isinstance(result, Future):
            result.add_done_callback(lambda done: _reply_when_done(done, call.method, reply))
        else:
            reply(result)

    # ---- stats, shutdown and failure ---------------------------------------------------------

    def make_engine_stats(self) -> EngineStats:
        """Called from the output thread: it reads counters the loop updates (a racy but safe
        snapshot under the GIL), so stats keep flowing while a long step runs."""
        stats = self.scheduler.make_stats()
        queries = stats.prefix_cache_queries
        return EngineStats(
            rank=self.rank,
            num_waiting_reqs=stats.num_waiting_reqs,
            num_running_reqs=stats.num_running_reqs,
            kv_cache_usage=stats.kv_cache_usage,
            prefix_cache_hit_rate=stats.prefix_cache_hits / queries if queries else 0.0,
            draining=self.shutdown_state is not ShutdownState.RUNNING,
            step_counter=stats.step_counter,
            exiting=self._exiting,
            prefix_cache_queries=queries,
            prefix_cache_hits=stats.prefix_cache_hits,
            num_preemptions=stats.num_preemptions,
            iteration_token_counts=list(self.step_tokens.counts),
            iteration_tokens_sum=self.step_tokens.total,
        )

    def request_shutdown(self) -> None:
        """Safe from a signal handler: records the request and wakes the loop (via a thread,
        because queue locks are not reentrant and the handler runs on the loop's thread)."""
        if self.shutdown_state is ShutdownState.RUNNING:
            self.shutdown_state = ShutdownState.REQUESTED
        self._wake.set()

    def _forward_wakeups(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            self.input_queue.put_nowait((EngineSignal.WAKEUP, None))

    def request_abort(self) -> None:
        """Shut down now, aborting every request whatever the shutdown mode, even mid-drain
        (safe from any thread). For a dead parent: it was the client, nobody is left to serve."""
        self._force_abort = True
        self.links.abandon()  # nobody reads the outputs: close without flushing
        self.request_shutdown()

    def _handle_shutdown(self) -> bool:
        """Advance the shutdown state machine; False when the loop should exit."""
        state = self.shutdown_state
        if state is ShutdownState.RUNNING:
            return True
        if state is ShutdownState.REQUESTED:
            self.shutdown_state = ShutdownState.SHUTTING_DOWN
            if self.health is not None:
                self.health.state = EngineState.DRAINING
            self.output_queue.put_nowait(STATS_NOW)  # the client learns "draining" at once
            cfg = self.proc_config
            in_flight = self.get_num_unfinished_requests()
            if cfg.shutdown_mode == "abort" or cfg.shutdown_timeout_s <= 0 or self._force_abort:
                logger.info("rank %d: shutting down, aborting %d request(s)", self.rank, in_flight)
                self._abort_all()
            else:
                logger.info(
                    "rank %d: draining %d request(s) for up to %.0f s",
                    self.rank,
                    in_flight,
                    cfg.shutdown_timeout_s,
                )
                self._drain_deadline = time.monotonic() + cfg.shutdown_timeout_s
        elif self._drain_deadline is not None and (
            self._force_abort or time.monotonic() >= self._drain_deadline
        ):
            logger.warning(
                "rank %d: %s; aborting %d request(s)",
                self.rank,
                "drain cut short" if self._force_abort else "drain timeout",
                self.get_num_unfinished_requests(),
            )
            self._drain_deadline = None
            self._abort_all()
        return self.scheduler.has_requests()

    def _abort_all(self) -> None:
        finished = self.scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)
        by_client: dict[int, list[str]] = {}
        for request in finished:
            by_client.setdefault(request.client_index, []).append(request.request_id)
        for client_index, ids in by_client.items():
            outputs = [
                EngineCoreOutput(
                    i, [], finish_reason=FinishReason.ABORT, stop_reason=SHUTTING_DOWN_MESSAGE
                )
                for i in ids
            ]
            message = EngineCoreOutputs(outputs=outputs, finished_requests=ids)
            self.output_queue.put_nowait((client_index, message))

    def _coordinator_lost(self, index: int) -> None:
        """A coordinator's connection dropped (it stopped, died or restarted): close its link
        and drop the requests it sent; they ended with it, or it has moved them elsewhere.
        The other coordinators' links serve on, and the joiner dials this one again."""
        link = self.links.close(index)
        if link is None:
            return  # a second report of a link already closed
        ids = [r.request_id for r in self.scheduler.requests.values() if r.client_index == index]
        if ids:
            self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        logger.warning(
            "rank %d: lost the coordinator at %s; dropped its %d request(s), joining it again",
            self.rank,
            link.address,
            len(ids),
        )
        self.joiner.wake()

    def _on_executor_failure(self, reason: str) -> None:
        self.input_queue.put_nowait((EngineSignal.EXECUTOR_FAILED, reason))

    def send_engine_dead(self, reason: str) -> None:
        """Tell the client this engine is dead (after a fatal error) and why, waiting up to
        5 s."""
        self.output_queue.put_nowait(DeadNotice(reason))
        if not self.links.join_output_threads(5.0):
            logger.critical("rank %d: could not send ENGINE_CORE_DEAD within 5 s", self.rank)

    def shutdown(self) -> None:
        """Stop the socket threads (outputs already queued are sent first), then the executor."""
        self.complete_idle_waiters()
        self.joiner.stop_event.set()  # no new link from now on
        self.joiner.join(timeout=2.0)
        self._exiting = True
        self.output_queue.put_nowait(STATS_NOW)  # "I have left": no wait for a heartbeat timeout
        stopped = self.links.stop()
        super().shutdown()
        if stopped and not self.joiner.is_alive():
            self.ctx.term()
        else:
            self.ctx.destroy(linger=0)


def _reply_when_done(done: Future[Any], method: str, reply: Any) -> None:
    if done.cancelled():
        reply(failure=f"call to {method} was cancelled")
    elif (exc := done.exception()) is not None:
        reply(failure=f"call to {method} failed: {exc}")
    else:
        reply(done.result())


def _discard(aborts: queue.SimpleQueue[list[str]]) -> None:
    while True:
        try:
            aborts.get_nowait()
        except queue.Empty:
            return
