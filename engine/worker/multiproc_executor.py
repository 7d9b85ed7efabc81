"""The multiprocess executor (``--distributed-executor-backend mp``, vLLM's name): one worker
process per device, tensor-parallel, driven from the engine process.

Every call (``execute_model``, ``sample_tokens``, ...) goes to every worker through its own
ZMQ PUSH socket (IPC, the project's msgpack codec); every worker answers on one PULL socket, and
worker 0's answer is the result. Calls run on one executor thread, so ``execute_model(...,
non_block=True)`` returns at once and the engine computes grammar masks meanwhile, as with
:class:`UniProcExecutor`.

A worker that dies (any exit the executor did not ask for) is seen by a watcher thread within
``WATCH_INTERVAL_S``: the failure callback gets the worker's rank, pid and exit status, a call
waiting for answers raises with the same text, and the engine turns it into ``ENGINE_CORE_DEAD``.
The workers hold the engine through their stdin: when the engine process dies, however, they
exit (``worker_proc``). ``shutdown`` stops them, and kills what does not stop.
"""

from __future__ import annotations

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
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import msgspec
import zmq

from corefleet.engine.config import EngineConfig
from corefleet.engine.core.scheduler_output import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from corefleet.engine.models.loader import load_arch_config
from corefleet.engine.models.tensor_parallel import check_tensor_parallel
from corefleet.engine.transport.serial import MsgpackDecoder, MsgpackEncoder
from corefleet.engine.worker.worker_proc import (
    ALL_ANSWER,
    READY,
    RESULT_TYPES,
    SHUTDOWN,
    WorkerSpec,
)

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.1  # how often the watcher looks at the workers
LOAD_TIMEOUT_S = 600.0  # a worker not ready by then is stuck (the model is loading slowly)
STOP_TIMEOUT_S = 5.0  # a worker told to stop and still there by then is killed
# After a worker exits, how long a waiting call still reads answers: the last words of the
# others (their collectives fail once a peer is gone) tell which one failed first.
EXIT_GRACE_S = 0.3


class WorkerFailed(RuntimeError):
    """A worker died or raised: the executor (and its engine) cannot go on."""


class MultiprocExecutor:
    """``tensor_parallel_size`` worker processes, one per device (see the module docstring)."""

    def __init__(self, config: EngineConfig, model_path: str) -> None:
        self.world_size = config.parallel.tensor_parallel_size
        # A layout the model cannot take fails here, before any process starts.
        check_tensor_parallel(load_arch_config(model_path), self.world_size)
        self._failure: str | None = None
        self._busy = False  # a call waits for answers
        self._exits: list[tuple[int, int, float, int]] = []  # rank, pid, when, exit code
        self._failure_callback: Callable[[str], None] | None = None
        self._stopping = False
        self._dir = tempfile.mkdtemp(prefix="corefleet-workers-")
        self._context = zmq.Context()
        self._replies = self._context.socket(zmq.PULL)
        self._replies.bind(f"ipc://{self._dir}/replies")
        self._calls = []
        for rank in range(self.world_size):
            calls = self._context.socket(zmq.PUSH)
            calls.bind(f"ipc://{self._dir}/calls-{rank}")
            self._calls.append(calls)
        self._encoder = MsgpackEncoder()
        self._decoders = {
            name: MsgpackDecoder(kind) for name, kind in RESULT_TYPES.items() if kind is not None
        }
        # Calls run here, in order: one in flight at a time.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="corefleet-mp-executor")
        self._procs = self._start_workers(config, model_path)
        self._watcher = threading.Thread(target=self._watch, name="corefleet-mp-watch", daemon=True)
        self._watcher.start()
        try:
            self._collect(READY, timeout_s=LOAD_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        logger.info("%d tensor-parallel workers ready", self.world_size)

    # ---- the Executor interface -----------------------------------------------------------

    def register_failure_callback(self, callback: Callable[[str], None]) -> None:
        """Called (from the watcher or the executor thread) with the reason a worker failed."""
        self._failure_callback = callback

    def determine_num_blocks(self) -> int:
        """The fewest blocks any worker can hold: every worker holds every block."""
        return min(self._pool.submit(self._call, "determine_num_blocks").result())

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._pool.submit(self._call, "initialize_kv_cache", num_blocks).result()

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> Future[ModelRunnerOutput | None]:
        future = self._pool.submit(self._first, "execute_model", scheduler_output)
        if not non_block:
            future.result()
        return future

    def sample_tokens(self, grammar_output: GrammarOutput) -> ModelRunnerOutput:
        result: ModelRunnerOutput = self._pool.submit(
            self._first, "sample_tokens", grammar_output
        ).result()
        return result

    def shutdown(self) -> None:
        """Stop the workers (killing any still there after ``STOP_TIMEOUT_S``)."""
        if self._stopping:
            return
        self._stopping = True
        self._pool.shutdown(wait=True, cancel_futures=True)
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
        self._context.destroy(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)

    # ---- calls ------------------------------------------------------------------------------

    def _first(self, method: str, arg: Any) -> Any:
        return self._call(method, arg)[0]

    def _call(self, method: str, arg: Any = None) -> list[Any]:
        """Send ``method(arg)`` to every worker; the results, in rank order (None where a
        worker sends none)."""
        header = json.dumps({"method": method}).encode()
        frames = [header, *(self._encoder.encode(arg) if arg is not None else [])]
        for calls in self._calls:
            calls.send_multipart(frames, copy=False)
        return self._collect(method)

    def _collect(self, method: str, timeout_s: float | None = None) -> list[Any]:
        """Every worker's answer to ``method``; raises :class:`WorkerFailed` when a worker
        fails first (see :meth:`_root_cause` for which failure is reported)."""
        results: list[Any] = [None] * self.world_size
        waiting = set(range(self.world_size))
        errors: dict[int, str] = {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._busy = True
        try:
            while waiting:
                if self._failure is not None:
                    raise WorkerFailed(self._failure)
                now = time.monotonic()
                if self._exits and now - self._exits[0][2] > EXIT_GRACE_S:
                    self._fail(self._root_cause(method, errors))
                    raise WorkerFailed(self._failure)
                if deadline is not None and now > deadline:
                    raise WorkerFailed(f"workers {sorted(waiting)} not ready after {timeout_s} s")
                if not self._replies.poll(int(WATCH_INTERVAL_S * 1000)):
                    continue
                frames = self._replies.recv_multipart(copy=False)
                header = json.loads(frames[0].bytes)
                rank = header["rank"]
                if header["error"] is not None:
                    errors[rank] = header["error"]  # the worker exits next: see _watch
                    continue
                decoder = self._decoders.get(method)
                if len(frames) > 1 and decoder is not None:
                    results[rank] = decoder.decode(frames[1:])
                waiting.discard(rank)
        finally:
            self._busy = False
        return results if method in ALL_ANSWER else results[:1]

    def _root_cause(self, method: str, errors: dict[int, str]) -> str:
        """The failure to report: a worker that died without a word (killed) caused the
        others' errors (a collective with a dead peer fails); otherwise the first error."""
        for rank, pid, _, code in self._exits:
            if rank not in errors:
                return f"tensor-parallel worker {rank} (pid {pid}) {_exit_status(code)}"
        rank = min(errors)
        return f"tensor-parallel worker {rank} failed in {method}: {errors[rank]}"

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
                world_size=self.world_size,
                dist_init=dist_init,
                calls=f"ipc://{self._dir}/calls-{rank}",
                replies=f"ipc://{self._dir}/replies",
            )
            argv = [sys.executable, "-m", "corefleet.engine.worker.worker_proc"]
            # stdin stays open: its end tells the worker the engine is gone.
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE)
            assert proc.stdin is not None
            proc.stdin.write(msgspec.json.encode(spec) + b"\n")
            proc.stdin.flush()
            procs.append(proc)
        return procs

    def _watch(self) -> None:
        """Record every worker that exits unasked. While a call waits for answers, it decides
        what to report (a dying worker's last message may still be on its way); otherwise
        the first exit is the failure."""
        seen: set[int] = set()
        while not self._stopping and self._failure is None:
            for rank, proc in enumerate(self._procs):
                code = proc.poll()
                if code is None or rank in seen or self._stopping:
                    continue
                seen.add(rank)
                self._exits.append((rank, proc.pid, time.monotonic(), code))
                if not self._busy:
                    self._fail(
                        f"tensor-parallel worker {rank} (pid {proc.pid}) {_exit_status(code)}"
                    )
            time.sleep(WATCH_INTERVAL_S)

    def _fail(self, reason: str) -> None:
        if self._failure is not None:
            return
        self._failure = reason
        logger.error("%s", reason)
        if self._failure_callback is not None:
            self._failure_callback(reason)


def _exit_status(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


def _free_port() -> int:
    """A TCP port free now, for worker 0's rendezvous (the workers bind it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
