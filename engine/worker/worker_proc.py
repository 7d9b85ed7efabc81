"""One worker process of tensor and pipeline parallelism: a :class:`ModelRunner` on its slice
or stage of the model, driven by the engine's :class:`MultiprocExecutor` over ZMQ.

The executor starts ``python -m corefleet.engine.worker.worker_proc`` and writes a
:class:`WorkerSpec` (JSON, one line) to its stdin, which it keeps open for the worker's life:
end of file on stdin means the engine process is gone, and the worker exits at once (a worker
must never outlive its engine, whatever killed it).

The worker joins the ``torch.distributed`` group (gloo on CPU, NCCL on CUDA), loads its part,
says it is ready, then serves calls in order: each call is ``[header, *payload]``, where the
header is JSON ``{"method": ..., "seq": ...}`` and the payload the msgpack of the argument (the
project's codec: no pickle). Every worker answers every call with its sequence number, so the
executor knows they all finished; the last pipeline stage's first worker carries the result
(all of them do for ``determine_num_blocks``, whose minimum counts). An exception is answered
with its text, and the worker exits: the group cannot go on without it.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

import msgspec
import torch
import torch.distributed as dist
import zmq

from corefleet.engine import envs
from corefleet.engine.config import EngineConfig
from corefleet.engine.core.scheduler_output import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from corefleet.engine.models.loader import load_arch_config
from corefleet.engine.models.pipeline_parallel import PipelineStage
from corefleet.engine.models.tensor_parallel import TensorParallel
from corefleet.engine.transport.serial import MsgpackDecoder, MsgpackEncoder
from corefleet.engine.worker.devices import resolve_device, set_cpu_threads
from corefleet.engine.worker.dtypes import resolve_dtype
from corefleet.engine.worker.kv_budget import WorkerMemory
from corefleet.engine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

READY = "ready"  # the header method of a worker's first message: loaded and listening
SHUTDOWN = "shutdown"
# What each call's payload decodes to, on the worker (arguments) and on the engine (results).
ARGUMENT_TYPES: dict[str, Any] = {
    "determine_num_blocks": None,
    "initialize_kv_cache": int,
    "execute_model": SchedulerOutput,
    "sample_tokens": GrammarOutput,
}
RESULT_TYPES: dict[str, Any] = {
    READY: None,
    "determine_num_blocks": int,
    "initialize_kv_cache": None,
    "execute_model": ModelRunnerOutput | None,
    "sample_tokens": ModelRunnerOutput,
}
ALL_ANSWER = {"determine_num_blocks"}  # every worker's result counts, not worker 0's alone


class WorkerSpec(msgspec.Struct, frozen=True):
    """What one worker is: its place in the group and where to find the executor. Global
    rank ``r`` is tensor-parallel rank ``r % tp`` of pipeline stage ``r // tp``."""

    config: EngineConfig
    model_path: str
    rank: int
    dist_init: str  # torch.distributed's init_method: tcp://127.0.0.1:PORT (worker 0 hosts it)
    calls: str  # the executor's PUSH socket for this worker
    replies: str  # the executor's PULL socket for every worker
    memory: WorkerMemory | None = None  # its part of the rank's memory on CPU (kv_budget.py)

    @property
    def world_size(self) -> int:
        return self.config.parallel.world_size

    @property
    def answers(self) -> bool:
        """Whether this worker's results are the step's: the last stage's first worker."""
        return self.rank == answering_rank(self.config)


def answering_rank(config: EngineConfig) -> int:
    """The global rank whose results are the step's (the last stage's first worker)."""
    parallel = config.parallel
    return (parallel.pipeline_parallel_size - 1) * parallel.tensor_parallel_size


def _groups(spec: WorkerSpec) -> tuple[TensorParallel, PipelineStage]:
    """This worker's tensor-parallel group (one per stage: every process creates every
    group, in the same order, as torch.distributed requires) and its pipeline stage."""
    tp_size = spec.config.parallel.tensor_parallel_size
    pp_size = spec.config.parallel.pipeline_parallel_size
    stage, tp_rank = divmod(spec.rank, tp_size)
    group = None  # the default group: all workers, when there is one stage
    if pp_size > 1 and tp_size > 1:
        for s in range(pp_size):
            made = dist.new_group(list(range(s * tp_size, (s + 1) * tp_size)))
            group = made if s == stage else group
    tp = TensorParallel(tp_rank, tp_size, group, stage * tp_size)
    return tp, PipelineStage(stage, pp_size, spec.rank, tp_size)


def worker_device(config: EngineConfig, rank: int) -> torch.device:
    """Worker ``rank``'s device: its own GPU, or the CPU."""
    device = resolve_device(config.device.device)
    return torch.device("cuda", rank) if device.type == "cuda" else device


def _exit_when_stdin_closes() -> None:
    """The engine holds our stdin open; its end means the engine died."""

    def watch() -> None:
        while sys.stdin.buffer.read(65536):
            pass
        os._exit(1)  # nobody to serve; skip the interpreter's teardown

    threading.Thread(target=watch, name="corefleet-engine-watch", daemon=True).start()


class Worker:
    """Serves one executor's calls with a model runner on this worker's slice."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        config = spec.config
        device = worker_device(config, spec.rank)
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend, init_method=spec.dist_init, rank=spec.rank, world_size=spec.world_size
        )
        torch.manual_seed(config.model.seed)
        arch = load_arch_config(spec.model_path)
        dtype = resolve_dtype(config.model.dtype, arch.torch_dtype, device)
        tp, stage = _groups(spec)
        self.runner = ModelRunner(
            config, arch, spec.model_path, device, dtype, tp, stage, spec.memory
        )
        self.runner.load_model()
        self.encoder = MsgpackEncoder()
        self.decoders = {
            name: MsgpackDecoder(kind) for name, kind in ARGUMENT_TYPES.items() if kind is not None
        }

    def serve(self, calls: zmq.Socket[bytes], replies: zmq.Socket[bytes]) -> None:
        """Answer calls until told to stop; an exception is answered, then raised."""
        self._reply(replies, 0, READY, None)
        while True:
            frames = calls.recv_multipart(copy=False)
            header = json.loads(frames[0].bytes)
            method, seq = header["method"], header.get("seq", 0)
            if method == SHUTDOWN:
                return
            try:
                result = self._call(method, frames[1:])
            except BaseException as exc:
                self._reply(replies, seq, method, None, error=_describe(exc))
                raise
            self._reply(replies, seq, method, result)

    def _call(self, method: str, payload: list[zmq.Frame]) -> Any:
        target: Callable[..., Any] = getattr(self.runner, method)
        decoder = self.decoders.get(method)
        if decoder is None:
            return target()
        return target(decoder.decode(payload))

    def _reply(
        self,
        replies: zmq.Socket[bytes],
        seq: int,
        method: str,
        result: Any,
        error: str | None = None,
    ) -> None:
        header = {"rank": self.spec.rank, "seq": seq, "method": method, "error": error}
        carries = error is None and (self.spec.answers or method in ALL_ANSWER)
        body = self.encoder.encode(result) if carries else []
        replies.send_multipart([json.dumps(header).encode(), *body], copy=False)


def main() -> None:
    """The process entry: read the spec from stdin, serve, exit.

    Exits through ``os._exit``: the interpreter's teardown would wait on the stdin watcher
    (and on torch's pools) for nothing."""
    logging.basicConfig(
        level=envs.log_level(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # The engine decides when its workers stop (SHUTDOWN, or its own end): a Ctrl-C in a
    # terminal reaches the whole process group, and must drain the rank, not kill its workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    spec = msgspec.json.decode(sys.stdin.buffer.readline(), type=WorkerSpec)
    _exit_when_stdin_closes()
    set_cpu_threads(spec.world_size)
    context = zmq.Context()
    calls = context.socket(zmq.PULL)
    calls.connect(spec.calls)
    replies = context.socket(zmq.PUSH)
    replies.connect(spec.replies)
    code = 0
    try:
        worker = Worker(spec)
    except Exception as exc:  # loading failed: say why before going
        logger.exception("tensor-parallel worker %d failed to start", spec.rank)
        header = {"rank": spec.rank, "seq": 0, "method": READY, "error": _describe(exc)}
        replies.send(json.dumps(header).encode())
        code = 1
    else:
        try:
            worker.serve(calls, replies)
        except Exception:
            logger.exception("tensor-parallel worker %d failed", spec.rank)
            code = 1
    replies.close(linger=2000)  # the last reply goes out before the exit
    logging.shutdown()
    os._exit(code)


def _describe(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()


if __name__ == "__main__":
    main()
