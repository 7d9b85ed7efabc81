"""The multiprocess clients: the engine in a child process, spoken to over ZMQ.

Death is noticed three ways, whichever comes first: the ``ENGINE_CORE_DEAD`` frame (a fatal
error the engine could still report), the process exiting (a monitor thread waits on it), or
silence longer than the heartbeat timeout (the engine sends stats every 0.5 s even when idle).
Each delivers one :class:`EngineDeadError` to every pending caller: ``get_output`` waiters and
utility calls alike.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import secrets
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from corefleet.engine.client.base import (
    AsyncEngineCoreClient,
    EngineCoreClient,
    EngineDeadError,
    MPClientOptions,
)
from corefleet.engine.client.launcher import launch_engine
from corefleet.engine.config import EngineConfig
from corefleet.engine.messages import (
    ENGINE_CORE_DEAD,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineStats,
    RequestType,
    SchedulerStats,
    UtilityCall,
    death_message,
)
from corefleet.engine.transport.handshake import describe_exit, rank_identity
from corefleet.engine.transport.serial import MsgpackDecoder, MsgpackEncoder

logger = logging.getLogger(__name__)


class MPClient:
    """What both multiprocess clients share: the engine, its death, and the wire."""

    def __init__(self, config: EngineConfig, options: MPClientOptions) -> None:
        launched = launch_engine(
            config,
            options.shutdown_mode,
            options.shutdown_timeout_s,
            options.curve_keys_dir,
            dict(options.extra_env),
        )
        self.resources = launched.resources
        self.engine_info = launched.info
        self.input_socket = launched.input
        self.output_socket = launched.output
        self.addresses = launched.addresses
        self.identity = rank_identity(0)
        self.heartbeat_timeout_s = options.resolved_heartbeat_timeout_s()
        self.dead: EngineDeadError | None = None
        self.engine_stats: EngineStats | None = None
        self.scheduler_stats: SchedulerStats | None = None
        self._encoder = MsgpackEncoder()
        self._decoder = MsgpackDecoder(EngineCoreOutputs)
        self._send_lock = threading.Lock()
        self._dead_lock = threading.Lock()
        # call id -> the caller's future; the caller removes its entry when it returns.
        self._utility_results: dict[int, Future[Any] | asyncio.Future[Any]] = {}
        # Idempotent clean-up, also when the client is garbage-collected or Python exits.
        self._finalizer = weakref.finalize(self, self.resources.shutdown, None)
        proc = self.resources.process
        assert proc is not None
        self.engine_pid = proc.pid
        self._monitor = threading.Thread(
            target=self._monitor_process, name="corefleet-engine-monitor", daemon=True
        )
        self._monitor.start()

    # ---- death -----------------------------------------------------------------------------

    def _monitor_process(self) -> None:
        proc = self.resources.process
        assert proc is not None
        code = proc.wait()
        if not self.resources.closing:
            # Exit 0 is a clean shutdown (e.g. SIGTERM from outside): gone, but not a failure.
            reason = f"engine core rank 0 (pid {proc.pid}) {describe_exit(code)}"
            self.mark_dead(reason, failure=code != 0)

    def mark_dead(self, reason: str, failure: bool = True) -> None:
        """Record the death once and fail every pending caller."""
        with self._dead_lock:
            if self.dead is not None:
                return
            self.dead = EngineDeadError(reason)
        if failure and not self.resources.closing:
            logger.error("engine core is dead: %s", reason)
        elif not self.resources.closing:
            logger.info("engine core is gone: %s", reason)
        self._deliver_dead(self.dead)

    def _deliver_dead(self, error: EngineDeadError) -> None:
        raise NotImplementedError

    def ensure_alive(self) -> None:
        if self.dead is not None:
            raise self.dead

    # ---- the wire --------------------------------------------------------------------------

    def _frames(self, kind: RequestType, payload: Any) -> list[Any]:
        return [self.identity, kind.value, *self._encoder.encode(payload)]

    def _new_call(self, method: str, args: Sequence[Any]) -> tuple[int, UtilityCall]:
        # Random ids: a stray or forged reply cannot complete another caller's call.
        call_id = secrets.randbits(63)
        return call_id, UtilityCall(0, call_id, method, list(args))

    def _on_frames(self, frames: list[zmq.Frame]) -> EngineCoreOutputs | None:
        """Decode one engine message; returns outputs worth queueing, None otherwise."""
        if frames[0].bytes == ENGINE_CORE_DEAD:
            self.mark_dead(death_message(frames))
            return None
        try:
            outputs = self._decoder.decode(frames)
        except (msgspec.MsgspecError, ValueError, TypeError) as exc:
            logger.warning("dropped an undecodable message from the engine: %s", exc)
            return None
        if outputs.engine_stats is not None:
            self.engine_stats = outputs.engine_stats
        if outputs.scheduler_stats is not None:
            self.scheduler_stats = outputs.scheduler_stats
        if outputs.utility_output is not None:
            self._resolve_utility(outputs)
            return None
        return outputs if outputs.outputs or outputs.finished_requests else None

    def _resolve_utility(self, outputs: EngineCoreOutputs) -> None:
        """Complete the waiting call (a concurrent or an asyncio Future: same methods here)."""
        reply = outputs.utility_output
        assert reply is not None
        future = self._utility_results.get(reply.call_id)
        if future is None or future.done():  # unknown id, or the caller gave up
            return
        if reply.failure_message is not None:
            future.set_exception(RuntimeError(reply.failure_message))
        else:
            future.set_result(reply.result)

    def _on_socket_error(self, exc: zmq.ZMQError) -> None:
        """The output socket failed under the reader. When the client is closing (also at
        Python's exit, where the finalizer closes the sockets) that is the expected end."""
        if not self.resources.closing:
            self.mark_dead(f"the engine's output socket failed: {exc}")

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the engine (SIGTERM, then SIGKILL after ``timeout``) and close everything."""
        self.resources.closing = True
        self._stop_reader()
        self.resources.shutdown(timeout)
        self.mark_dead("the client was shut down")

    def _stop_reader(self) -> None:
        raise NotImplementedError


class SyncMPClient(MPClient, EngineCoreClient):
    """Blocking calls; a reader thread decodes outputs into a queue."""

    def __init__(self, config: EngineConfig, options: MPClientOptions) -> None:
        super().__init__(config, options)
        self.outputs_queue: queue.Queue[EngineCoreOutputs | EngineDeadError] = queue.Queue()
        self._stop_reading = threading.Event()
        self._reader = threading.Thread(target=self._read_outputs, name="corefleet-outputs")
        self._reader.daemon = True
        self._reader.start()

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(self._frames(RequestType.ADD, request))

    def abort_requests(self, request_ids: list[str]) -> None:
        if self.dead is None and request_ids:
            self._send(self._frames(RequestType.ABORT, request_ids))

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        try:
            item = self.outputs_queue.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no output from the engine core in {timeout} s") from None
        if isinstance(item, EngineDeadError):
            self.outputs_queue.put_nowait(item)  # wake the next waiter too
            raise item
        return item

    def call_utility(self, method: str, *args: Any) -> Any:
        call_id, call = self._new_call(method, args)
        future: Future[Any] = Future()
        self._utility_results[call_id] = future
        try:
            self._send(self._frames(RequestType.UTILITY, call))
            if self.dead is not None:  # died between the registration and the send
                raise self.dead
            return future.result()
        finally:
            self._utility_results.pop(call_id, None)

    def _send(self, frames: list[Any]) -> None:
        self.ensure_alive()
        with self._send_lock:
            try:
                self.input_socket.send_multipart(frames, copy=False)
            except zmq.ZMQError as exc:  # ROUTER_MANDATORY: the engine is not connected
                self.mark_dead(f"cannot reach the engine core: {exc}")
                raise EngineDeadError(f"cannot reach the engine core: {exc}") from exc

    def _read_outputs(self) -> None:
        try:
            self._read_until_stopped()
        except zmq.ZMQError as exc:
            self._on_socket_error(exc)

    def _read_until_stopped(self) -> None:
        sock = self.output_socket
        last_heard = time.monotonic()
        while not self._stop_reading.is_set() and self.dead is None:
            if not sock.poll(100):
                if time.monotonic() - last_heard > self.heartbeat_timeout_s:
                    silence = time.monotonic() - last_heard
                    self.mark_dead(f"no message from the engine core for {silence:.1f} s")
                continue
            last_heard = time.monotonic()
            outputs = self._on_frames(sock.recv_multipart(copy=False))
            if outputs is not None:
                self.outputs_queue.put_nowait(outputs)

    def _deliver_dead(self, error: EngineDeadError) -> None:
        self.outputs_queue.put_nowait(error)
        pending, self._utility_results = self._utility_results, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(error)

    def _stop_reader(self) -> None:
        self._stop_reading.set()
        if self._reader is not threading.current_thread():
            self._reader.join(timeout=2.0)


class AsyncMPClient(MPClient, AsyncEngineCoreClient):
    """asyncio calls; a reader task (started on first use, in the caller's loop) decodes outputs.

    Use it from one event loop.
    """

    def __init__(self, config: EngineConfig, options: MPClientOptions) -> None:
        super().__init__(config, options)
        self._input = zmq.asyncio.Socket.from_socket(self.input_socket)
        self._output = zmq.asyncio.Socket.from_socket(self.output_socket)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue[EngineCoreOutputs | EngineDeadError] | None = None
        self._reader: asyncio.Task[None] | None = None

    def _start(self) -> asyncio.Queue[EngineCoreOutputs | EngineDeadError]:
        if self._queue is None:
            self._loop = asyncio.get_running_loop()
            self._queue = asyncio.Queue()
            self._reader = self._loop.create_task(self._read_outputs())
            if self.dead is not None:
                self._queue.put_nowait(self.dead)
        return self._queue

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self._start()
        await self._send(self._frames(RequestType.ADD, request))

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self._start()
        if self.dead is None and request_ids:
            await self._send(self._frames(RequestType.ABORT, request_ids))

    async def get_output_async(self) -> EngineCoreOutputs:
        outputs_queue = self._start()
        item = await outputs_queue.get()
        if isinstance(item, EngineDeadError):
            outputs_queue.put_nowait(item)  # wake the next waiter too
            raise item
        return item

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        self._start()
        assert self._loop is not None
        call_id, call = self._new_call(method, args)
        future: asyncio.Future[Any] = self._loop.create_future()
        self._utility_results[call_id] = future
        try:
            await self._send(self._frames(RequestType.UTILITY, call))
            return await future
        finally:
            self._utility_results.pop(call_id, None)

    async def _send(self, frames: list[Any]) -> None:
        self.ensure_alive()
        try:
            await self._input.send_multipart(frames, copy=False)
        except zmq.ZMQError as exc:
            self.mark_dead(f"cannot reach the engine core: {exc}")
            raise EngineDeadError(f"cannot reach the engine core: {exc}") from exc

    async def _read_outputs(self) -> None:
        try:
            await self._read_until_stopped()
        except zmq.ZMQError as exc:
            self._on_socket_error(exc)

    async def _read_until_stopped(self) -> None:
        last_heard = time.monotonic()
        assert self._queue is not None
        while self.dead is None:
            if not await self._output.poll(100):
                if time.monotonic() - last_heard > self.heartbeat_timeout_s:
                    silence = time.monotonic() - last_heard
                    self.mark_dead(f"no message from the engine core for {silence:.1f} s")
                continue
            last_heard = time.monotonic()
            outputs = self._on_frames(await self._output.recv_multipart(copy=False))
            if outputs is not None:
                self._queue.put_nowait(outputs)

    def _deliver_dead(self, error: EngineDeadError) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return  # no caller is waiting; the next call raises at once
        if _running_loop() is loop:
            self._fail_pending(error)
        else:
            loop.call_soon_threadsafe(self._fail_pending, error)

    def _fail_pending(self, error: EngineDeadError) -> None:
        if self._queue is not None:
            self._queue.put_nowait(error)
        for future in self._utility_results.values():
            if not future.done():
                future.set_exception(error)

    def _stop_reader(self) -> None:
        if self._reader is not None and not self._reader.done():
            self._reader.cancel()


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
