"""The two socket threads of an engine process: requests in, outputs out.

Both keep ZMQ work (and msgpack decoding and encoding) off the busy loop's thread; they talk to
it only through queues. The input thread never lets a bad frame through and never dies of one:
garbage, an unknown type byte or a message with wrong fields is counted, logged at most once a
second, and dropped; a well-formed ADD the engine cannot serve becomes an ``error`` output for
that request.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import zmq
import zmq.utils.monitor

from corefleet.engine.messages import (
    ENGINE_CORE_DEAD,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineStats,
    FinishReason,
    ReadyResponse,
    RequestType,
    StartDPWave,
    UtilityCall,
    UtilityOutput,
)
from corefleet.engine.request import Request
from corefleet.engine.transport.serial import MsgpackDecoder, MsgpackEncoder
from corefleet.engine.transport.sockets import CurveKeys, make_socket

logger = logging.getLogger(__name__)


class EngineSignal(enum.Enum):
    """Markers the engine process puts on its own input queue; never on the wire.

    They are apart from ``RequestType`` so that no frame a client sends can decode into one.
    """

    EXECUTOR_FAILED = enum.auto()  # payload: the reason; the busy loop raises it (fatal)
    WAKEUP = enum.auto()  # payload: None; only unblocks a busy loop waiting for input
    COORDINATOR_LOST = enum.auto()  # payload: the link's client index; its connection dropped


# What the busy loop receives: (kind, payload); payload is a Request (ADD), a list of ids
# (ABORT), a UtilityCall (UTILITY), a StartDPWave (START_DP_WAVE), or as EngineSignal says.
InputItem = tuple[RequestType | EngineSignal, Any]
STATS_NOW = "stats-now"
# The most of a death's reason that travels with ENGINE_CORE_DEAD (a traceback's last line).
MAX_DEATH_REASON_BYTES = 1000


@dataclass(frozen=True)
class DeadNotice:
    """Tell the client this engine is dead, and why: ``[ENGINE_CORE_DEAD, rank, reason]``."""

    reason: str

    def frames(self, engine_index: int) -> list[bytes]:
        reason = self.reason.encode("utf-8", "replace")[:MAX_DEATH_REASON_BYTES]
        return [ENGINE_CORE_DEAD, engine_index.to_bytes(2, "little"), reason]


# What the output thread sends: (client index, outputs), STATS_NOW, a DeadNotice, or None
# (flush and stop).
OutputItem = tuple[int, EngineCoreOutputs] | str | DeadNotice | None

_DECODE_ERRORS = (msgspec.MsgspecError, ValueError, TypeError)
_POLL_MS = 100


class OutputSink(Protocol):
    """Where outputs go: a queue, or the router over a rank's coordinator links."""

    def put_nowait(self, item: OutputItem) -> None: ...


class InputSink(Protocol):
    """What the input thread needs from the engine."""

    input_queue: queue.SimpleQueue[InputItem]
    aborts_queue: queue.SimpleQueue[list[str]]

    @property
    def output_queue(self) -> OutputSink: ...

    def preprocess_add_request(self, request: EngineCoreRequest) -> Request: ...


def error_outputs(
    request: EngineCoreRequest | Request, reason: FinishReason, message: str
) -> tuple[int, EngineCoreOutputs]:
    """``(client_index, EngineCoreOutputs)`` finishing one request with ``reason``."""
    output = EngineCoreOutput(request.request_id, [], finish_reason=reason, stop_reason=message)
    return (request.client_index, EngineCoreOutputs(outputs=[output]))


class _DropLog:
    """Counts dropped frames and logs at most once a second (a flood must not flood the log)."""

    def __init__(self) -> None:
        self.total = 0
        self._unlogged = 0
        self._last_log = 0.0

    def drop(self, reason: str) -> None:
        self.total += 1
        self._unlogged += 1
        now = time.monotonic()
        if now - self._last_log >= 1.0:
            logger.warning("dropped %d malformed frame(s); latest: %s", self._unlogged, reason)
            self._unlogged, self._last_log = 0, now


def _as_bytes(frame: zmq.Frame | bytes) -> bytes:
    return frame.bytes if isinstance(frame, zmq.Frame) else bytes(frame)


class InputThread(threading.Thread):
    """Connects the input DEALER, says ReadyResponse, then decodes requests into the queues.

    Every request and utility call gets ``client_index``, the index of this coordinator's
    link, whatever its sender wrote there: outputs go back by it (``links.py``).
    """

    def __init__(
        self,
        ctx: zmq.Context,
        address: str,
        identity: bytes,
        curve: CurveKeys | None,
        ready_response: ReadyResponse,
        engine: InputSink,
        client_index: int = 0,
    ) -> None:
        super().__init__(name=f"corefleet-input-{client_index}", daemon=True)
        self.ctx, self.address, self.identity, self.curve = ctx, address, identity, curve
        self.client_index = client_index
        self.ready_response = ready_response
        self.engine = engine
        self.ready = threading.Event()
        self.stop_event = threading.Event()
        self.drops = _DropLog()
        self._add_decoder = MsgpackDecoder(EngineCoreRequest)
        self._abort_decoder = MsgpackDecoder(list[str])
        self._utility_decoder = MsgpackDecoder(UtilityCall)
        self._wave_decoder = MsgpackDecoder(StartDPWave)

    def run(self) -> None:
        sock = make_socket(
            self.ctx, zmq.DEALER, self.address, bind=False, identity=self.identity, curve=self.curve
        )
        # A dropped connection is how a coordinator restart shows up here (ZMQ would reconnect
        # by itself, but the new coordinator knows nothing of this rank): tell the busy loop.
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            sock.send_multipart(MsgpackEncoder().encode(self.ready_response))
            self.ready.set()
            while not self.stop_event.is_set():
                events = dict(poller.poll(_POLL_MS))
                if sock in events:
                    self.dispatch(sock.recv_multipart(copy=False))
                if monitor in events:
                    zmq.utils.monitor.recv_monitor_message(monitor)
                    lost = (EngineSignal.COORDINATOR_LOST, self.client_index)
                    self.engine.input_queue.put_nowait(lost)
        except Exception as exc:  # a bug here: the engine can no longer hear its clients
            logger.exception("the input thread failed")
            self.engine.input_queue.put_nowait(
                (EngineSignal.EXECUTOR_FAILED, f"the input thread failed: {exc!r}")
            )
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close()

    def dispatch(self, frames: Sequence[zmq.Frame | bytes]) -> None:
        """Decode one client message and queue it; anything malformed is dropped."""
        if len(frames) < 2:
            self.drops.drop(f"{len(frames)} frame(s); expected a type byte and a payload")
            return
        kind, payload = _as_bytes(frames[0]), frames[1:]
        try:
            if kind == RequestType.ADD.value:
                self._add(self._add_decoder.decode(payload))
            elif kind == RequestType.ABORT.value:
                ids = self._abort_decoder.decode(payload)
                self.engine.aborts_queue.put_nowait(ids)
                self.engine.input_queue.put_nowait((RequestType.ABORT, ids))
            elif kind == RequestType.UTILITY.value:
                call = self._utility_decoder.decode(payload)
                call.client_index = self.client_index
                self.engine.input_queue.put_nowait((RequestType.UTILITY, call))
            elif kind == RequestType.START_DP_WAVE.value:
                wave = self._wave_decoder.decode(payload)
                self.engine.input_queue.put_nowait((RequestType.START_DP_WAVE, wave))
            else:
                self.drops.drop(f"unknown request type {kind[:4]!r}")
        except _DECODE_ERRORS as exc:
            self.drops.drop(f"undecodable {kind[:4]!r} message: {exc}")

    def _add(self, request: EngineCoreRequest) -> None:
        request.client_index = self.client_index
        try:
            prepared = self.engine.preprocess_add_request(request)
        except Exception as exc:  # request-scoped: this request fails, the engine serves on
            logger.info("request %r refused: %s", request.request_id, exc)
            failed = error_outputs(request, FinishReason.ERROR, str(exc))
            self.engine.output_queue.put_nowait(failed)
            return
        self.engine.input_queue.put_nowait((RequestType.ADD, prepared))


class OutputThread(threading.Thread):
    """Connects the output PUSH and sends outputs, plus EngineStats at least every interval.

    Messages are encoded into reusable buffers and sent zero-copy; a buffer goes back to the
    free list only when ZMQ reports it sent (its tracker is done).
    """

    def __init__(
        self,
        ctx: zmq.Context,
        address: str,
        curve: CurveKeys | None,
        output_queue: queue.SimpleQueue[OutputItem],
        make_stats: Callable[[], EngineStats],
        engine_index: int,
        stats_interval_s: float = 0.5,
    ) -> None:
        super().__init__(name="corefleet-output", daemon=True)
        self.ctx, self.address, self.curve = ctx, address, curve
        self.output_queue = output_queue
        self.make_stats = make_stats
        self.engine_index = engine_index
        self.stats_interval_s = stats_interval_s
        self._encoder = MsgpackEncoder()
        self._free: list[bytearray] = []
        self._pending: deque[tuple[zmq.MessageTracker, bytearray]] = deque()
        # An item taken from the queue while merging that must be handled next (it may be the
        # None sentinel itself, hence a list rather than an Optional).
        self._carried: list[OutputItem] = []
        self.abandoned = False  # the peer is gone: close without waiting to flush

    def run(self) -> None:
        sock = make_socket(self.ctx, zmq.PUSH, self.address, bind=False, curve=self.curve)
        sock.setsockopt(zmq.LINGER, 4000)  # flush the last outputs before the process exits
        next_stats = 0.0
        try:
            while True:
                try:
                    if self._carried:
                        item = self._carried.pop()
                    else:
                        timeout = max(0.0, next_stats - time.monotonic())
                        item = self.output_queue.get(timeout=timeout)
                except queue.Empty:
                    item = STATS_NOW
                if item is None:
                    return
                if isinstance(item, DeadNotice):
                    sock.send_multipart(item.frames(self.engine_index))
                    return
                outputs = self._merge_backlog(item) if isinstance(item, tuple) else None
                outputs = outputs or EngineCoreOutputs()
                now = time.monotonic()
                if item == STATS_NOW or now >= next_stats:
                    outputs.engine_stats = self.make_stats()
                    next_stats = now + self.stats_interval_s
                outputs.engine_index = self.engine_index
                self._send(sock, outputs)
        except Exception:
            logger.exception("the output thread failed")
        finally:
            sock.close(linger=0 if self.abandoned else None)

    def _merge_backlog(self, item: tuple[int, EngineCoreOutputs]) -> EngineCoreOutputs:
        """Fold the step outputs already queued behind ``item`` into one message.

        When the engine steps faster than this thread sends, one message per backlog instead
        of one per step saves a send and a client-side decode per step. Only plain step
        outputs merge; the first other item (a utility reply, a wave notice, a sentinel) stays
        queued next.
        """
        outputs = item[1]
        if outputs.utility_output is not None:
            return outputs
        while not self._carried:
            try:
                following = self.output_queue.get_nowait()
            except queue.Empty:
                break
            if not (
                isinstance(following, tuple)
                and following[0] == item[0]
                and following[1].utility_output is None
                and following[1].wave_complete is None
                and following[1].start_wave is None
            ):
                self._carried.append(following)
                break
            more = following[1]
            outputs.outputs += more.outputs
            if more.finished_requests:
                outputs.finished_requests = (
                    outputs.finished_requests or []
                ) + more.finished_requests
            outputs.scheduler_stats = more.scheduler_stats or outputs.scheduler_stats
        return outputs

    def _send(self, sock: zmq.Socket, outputs: EngineCoreOutputs) -> None:
        buffer = self._take_buffer()
        try:
            frames = self._encoder.encode_into(outputs, buffer)
        except _DECODE_ERRORS as exc:
            utility = outputs.utility_output
            if utility is None:
                logger.error("could not encode engine outputs: %s", exc)
                return
            # A utility returned something msgpack cannot carry: the caller gets the reason.
            outputs.utility_output = UtilityOutput(
                utility.call_id, failure_message=f"the result could not be serialized: {exc}"
            )
            frames = self._encoder.encode_into(outputs, buffer)
        tracker = sock.send_multipart(frames, copy=False, track=True)
        if tracker is None or tracker.done:
            self._free.append(buffer)
        else:
            self._pending.append((tracker, buffer))

    def _take_buffer(self) -> bytearray:
        while self._pending and self._pending[0][0].done:
            self._free.append(self._pending.popleft()[1])
        return self._free.pop() if self._free else bytearray()
