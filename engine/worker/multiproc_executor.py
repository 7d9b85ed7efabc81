"""The multiprocess executor (``--distributed-executor-backend mp``, vLLM's name): one worker
process per device, ``tensor_parallel_size`` x ``pipeline_parallel_size`` of them, driven from
the engine process.

Every call (``execute_model``, ``sample_tokens``, ...) goes at once to every worker through its
own ZMQ PUSH socket (IPC, the project's msgpack codec), numbered; the caller gets a future. A
reader thread takes the workers' answers from one PULL socket and completes a call's future
once every worker has answered it; the last pipeline stage's first worker carries the result.
So ``execute_model(..., non_block=True)`` returns at once: the engine computes grammar masks
meanwhile, and under pipeline parallelism launches the next steps (up to one per stage) before
the first is done. Each worker serves its calls in order.

The reader also watches the worker processes, every ``WATCH_INTERVAL_S``. A worker that exits
unasked fails the executor: the failure callback gets the worker's rank, pid and exit status,
every pending call raises the same, and the engine turns it into ``ENGINE_CORE_DEAD``. When a
worker is killed its peers' collectives fail too, and they report errors: the reader waits
``EXIT_GRACE_S`` after the first exit and reports the worker that died without a word, else the
first error. The workers hold the engine through their stdin: when the engine process dies,
however, they exit (``worker_proc``). ``shutdown`` stops them, and kills what does not stop.
"""

from __future__ import annotations

import itertools
import json
import logging
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from corefleet.engine.config import EngineConfig
from corefleet.engine.core.scheduler_output import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from corefleet.engine.models.loader import load_arch_config
from corefleet.engine.models.pipeline_parallel import check_pipeline_parallel
from corefleet.engine.models.tensor_parallel import check_tensor_parallel
from corefleet.engine.transport.serial import MsgpackDecoder, MsgpackEncoder
from corefleet.engine.worker.devices import resolve_device
from corefleet.engine.worker.kv_budget import WorkerMemory, check_explicit_budget
from corefleet.engine.worker.worker_proc import (
    READY,
    RESULT_TYPES,
    SHUTDOWN,
    WorkerSpec,
    answering_rank,
)

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.1  # how often the reader looks at the workers when no answer comes
LOAD_TIMEOUT_S = 600.0  # a worker not ready by then is stuck (the model is loading slowly)
STOP_TIMEOUT_S = 5.0  # a worker told to stop and still there by then is killed
# After a worker exits, how long the reader still takes answers: the last words of the others
# (their collectives fail once a peer is gone) tell which one failed first.
EXIT_GRACE_S = 0.3


class WorkerFailed(RuntimeError):
    """A worker died or raised: the executor (and its engine) cannot go on."""


@dataclass
class _Call:
    """A call every worker must answer."""

    method: str
    future: Future[list[Any]]
    waiting: set[int]
    results: list[Any] = field(default_factory=list)


class MultiprocExecutor:
    """One worker process per device (see the module docstring)."""

    def __init__(self, config: EngineConfig, model_path: str) -> None:
        parallel = config.parallel
        self.world_size = parallel.world_size
        self._answering = answering_rank(config)
        # A layout the model cannot take fails here, before any process starts.
        arch = load_arch_config(model_path)
        check_tensor_parallel(arch, parallel.tensor_parallel_size)
        check_pipeline_parallel(arch.num_hidden_layers, parallel.pipeline_parallel_size)
        # The rank's memory, read before any worker loads, split among the workers; an explicit
        # KV budget beyond it is refused before they start.
        on_cpu = resolve_device(config.device.device).type == "cpu"
        self._memory = WorkerMemory.for_rank(config) if on_cpu else None
        check_explicit_budget(config, self._memory)
        self._failure: str | None = None
        self._failure_callback: Callable[[str], None] | None = None
        self._stopping = False
        self._exits: list[tuple[int, int, float, int]] = []  # rank, pid, when, exit code
        self._errors: dict[int, tuple[str, str]] = {}  # rank -> (method, error) it answered
        self._dir = tempfile.mkdtemp(prefix="corefleet-workers-")
        self._context = zmq.Context()
        self._replies = self._context.socket(zmq.PULL)
        self._replies.bind(f"ipc://{self._dir}/replies")
        self._calls: list[zmq.Socket[bytes]] = []
        for rank in range(self.world_size):
            calls = self._context.socket(zmq.PUSH)
            calls.bind(f"ipc://{self._dir}/calls-{rank}")
            self._calls.append(calls)
        self._encoder = MsgpackEncoder()
        self._decoders = {
            name: MsgpackDecoder(kind) for name, kind in RESULT_TYPES.items() if kind is not None
        }
        self._seq = itertools.count(1)  # 0 is every worker's READY
        self._lock = threading.Lock()  # the pending calls, shared with the reader
        self._pending: dict[int, _Call] = {0: self._new_call(READY)}
        self._procs = self._start_workers(config, model_path)
        self._reader = threading.Thread(target=self._read, name="corefleet-mp-reader", daemon=True)
        self._reader.start()
        try:
            self._wait(self._pending[0].future, LOAD_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        logger.info("%d workers ready", self.world_size)

    # ---- the Executor interface -----------------------------------------------------------

    def register_failure_callback(self, callback: Callable[[str], None]) -> None:
        """Called (from the reader thread) with the reason a worker failed."""
        self._failure_callback = callback

    def determine_num_blocks(self) -> int:
        """The fewest blocks any worker can hold: every worker holds every block."""
        return min(self._wait(self._send("determine_num_blocks")))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._wait(self._send("initialize_kv_cache", num_blocks))

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> Future[ModelRunnerOutput | None]:
        future = self._answer(self._send("execute_model", scheduler_output))
        if not non_block:
            future.result()
        return future

    def sample_tokens(self, grammar_output: GrammarOutput) -> ModelRunnerOutput:
        result: ModelRunnerOutput = self._wait(self._send("sample_tokens", grammar_output))[
            self._answering
        ]
        return result

    def execute_dummy_batch(self) -> None:
        """Never needed: an MoE group runs its model in the engine process (tensor and pipeline
        parallel size 1; ``engine_core/entry.py`` refuses the others)."""
        raise NotImplementedError("dummy batches need tensor and pipeline parallel size 1")

    def shutdown(self) -> None:
        """Stop the workers (killing any still there after ``STOP_TIMEOUT_S``)."""
        if self._stopping:
            return
        self._stopping = True
        header = json.dumps({"method": SHUTDOWN}).encode()
        for calls in self._calls:
            calls.send(header, flags=zmq.NOBLOCK)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in self._procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdin is not None:
                proc.stdin.close()
        self._reader.join(timeout=2 * WATCH_INTERVAL_S + 1.0)
        self._fail_pending("the executor was shut down")
        self._context.destroy(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)

    # ---- calls ------------------------------------------------------------------------------

    def _new_call(self, method: str) -> _Call:
        return _Call(method, Future(), set(range(self.world_size)), [None] * self.world_size)

    def _send(self, method: str, arg: Any = None) -> Future[list[Any]]:
        """Send ``method(arg)`` to every worker; a future of their results in rank order (None
        where a worker sends none)."""
        call = self._new_call(method)
        with self._lock:
            if self._failure is not None:
                raise WorkerFailed(self._failure)
            seq = next(self._seq)
            self._pending[seq] = call
        header = json.dumps({"method": method, "seq": seq}).encode()
        frames = [header, *(self._encoder.encode(arg) if arg is not None else [])]
        for calls in self._calls:
            calls.send_multipart(frames, copy=False)
        return call.future

    def _answer(self, results: Future[list[Any]]) -> Future[ModelRunnerOutput | None]:
        """The answering worker's result of ``results``, as a future of its own."""
        answer: Future[ModelRunnerOutput | None] = Future()

        def done(future: Future[list[Any]]) -> None:
            error = future.exception()
            if error is not None:
                answer.set_exception(error)
            else:
                answer.set_result(future.result()[self._answering])

        results.add_done_callback(done)
        return answer

    @staticmethod
    def _wait(future: Future[list[Any]], timeout_s: float | None = None) -> list[Any]:
        try:
            return future.result(timeout=timeout_s)
        except TimeoutError:
            raise WorkerFailed(f"the workers did not answer within {timeout_s:.0f} s") from None

    # ---- the reader thread ----------------------------------------------------------------

    def _read(self) -> None:
        """Complete calls as their answers come; watch the workers between answers."""
        while not self._stopping and self._failure is None:
            if self._replies.poll(int(WATCH_INTERVAL_S * 1000)):
                self._take(self._replies.recv_multipart(copy=False))
            self._watch()

    def _take(self, frames: list[zmq.Frame]) -> None:
        header = json.loads(frames[0].bytes)
        rank, method = header["rank"], header["method"]
        if header["error"] is not None:
            self._errors[rank] = (method, header["error"])  # the worker exits next
            return
        with self._lock:
            call = self._pending.get(header["seq"])
        if call is None:
            return
        decoder = self._decoders.get(method)
        if len(frames) > 1 and decoder is not None:
            call.results[rank] = decoder.decode(frames[1:])
        call.waiting.discard(rank)
        if not call.waiting:
            with self._lock:
                self._pending.pop(header["seq"], None)
            call.future.set_result(call.results)

    def _watch(self) -> None:
        seen = {rank for rank, *_ in self._exits}
        for rank, proc in enumerate(self._procs):
            code = proc.poll()
            if code is not None and rank not in seen and not self._stopping:
                self._exits.append((rank, proc.pid, time.monotonic(), code))
        if self._exits and time.monotonic() - self._exits[0][2] > EXIT_GRACE_S:
            self._fail(self._root_cause())

    def _root_cause(self) -> str:
        """The failure to report: a worker that died without a word (killed) caused the
        others' errors (a collective with a dead peer fails); otherwise the first error."""
        for rank, pid, _, code in self._exits:
            if rank not in self._errors:
                return f"worker {rank} (pid {pid}) {_exit_status(code)}"
        rank = min(self._errors)
        method, error = self._errors[rank]
        return f"worker {rank} failed in {method}: {error}"

    def _fail(self, reason: str) -> None:
        if self._failure is not None:
            return
        reason = f"tensor/pipeline-parallel {reason}"
        with self._lock:
            self._failure = reason
        logger.error("%s", reason)
        self._fail_pending(reason)
        if self._failure_callback is not None:
            self._failure_callback(reason)

    def _fail_pending(self, reason: str) -> None:
        with self._lock:
            calls, self._pending = list(self._pending.values()), {}
        for call in calls:
            if not call.future.done():
                call.future.set_exception(WorkerFailed(reason))

    # ---- the workers ------------------------------------------------------------------------

    def _start_workers(
        self, config: EngineConfig, model_path: str
    ) -> list[subprocess.Popen[bytes]]:
        dist_init = f"tcp://127.0.0.1:{_free_port()}"
        procs = []
        for rank in range(self.world_size):
            spec = WorkerSpec(
                config=config,
                model_path=model_path,
                rank=rank,
                dist_init=dist_init,
                calls=f"ipc://{self._dir}/calls-{rank}",
                replies=f"ipc://{self._dir}/replies",
                memory=self._memory,
            )
            argv = [sys.executable, "-m", "corefleet.engine.worker.worker_proc"]
            # stdin stays open: its end tells the worker the engine is gone.
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE)
            assert proc.stdin is not None
            proc.stdin.write(msgspec.json.encode(spec) + b"\n")
            proc.stdin.flush()
            procs.append(proc)
        return procs


def _exit_status(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


def _free_port() -> int:
    """A TCP port free now, for worker 0's rendezvous (the workers bind it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
