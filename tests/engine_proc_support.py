"""Helpers for tests that run real engine processes on the tiny model."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import zmq

from corefleet.engine.client.base import EngineCoreClient
from corefleet.engine.client.inproc import InprocClient
from corefleet.engine.config import EngineConfig
from corefleet.engine.coordinator.fleet_client import FleetClient
from corefleet.engine.coordinator.routing import make_policy
from corefleet.engine.engine_args import engine_argv_from_config
from corefleet.engine.messages import EngineCoreRequest, FinishReason, SamplingParams
from corefleet.engine.transport.handshake import HandshakeServer
from corefleet.engine.transport.sockets import bound_address, make_socket

T = TypeVar("T")
TESTS_DIR = Path(__file__).resolve().parent


def child_env(folder: Path) -> tuple[tuple[str, str], ...]:
    """Environment for an engine process that must import ``tests.engine_faults``.

    Only ``tests`` goes on its path (through a link in ``folder``): the repository root itself
    would let its ``operator/`` folder shadow the standard library's ``operator``.
    """
    link = folder / "tests"
    if not link.exists():
        link.symlink_to(TESTS_DIR, target_is_directory=True)
    return (("PYTHONPATH", str(folder)),)


PROMPTS = [[5 + (i * 11 + j * 7) % 300 for j in range(n)] for i, n in enumerate([3, 9, 17, 33])]


def tiny_config(model: Path, **kwargs: object) -> EngineConfig:
    return EngineConfig.from_kwargs(
        model=str(model), dtype="float32", kv_cache_memory=8 << 20, block_size=4, **kwargs
    )


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@dataclass
class Finished:
    tokens: list[int] = field(default_factory=list)
    reason: FinishReason | None = None
    message: str | int | None = None


def collect(client: EngineCoreClient, ids: set[str], timeout: float = 60.0) -> dict[str, Finished]:
    """Read outputs until every request in ``ids`` finished; other ids are ignored."""
    results = {i: Finished() for i in ids}
    pending = set(ids)
    deadline = time.monotonic() + timeout
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"requests {sorted(pending)} did not finish in {timeout} s")
        for out in client.get_output(timeout=left).outputs:
            if out.request_id not in results:
                continue
            result = results[out.request_id]
            result.tokens += out.new_token_ids
            if out.finished:
                result.reason, result.message = out.finish_reason, out.stop_reason
                pending.discard(out.request_id)
    return results


def generate(
    client: EngineCoreClient, prompts: list[list[int]], max_tokens: int
) -> list[list[int]]:
    """Greedy tokens for each prompt, through any client."""
    ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        client.add_request(EngineCoreRequest(request_id, prompt, greedy(max_tokens)))
    results = collect(client, set(ids))
    return [results[i].tokens for i in ids]


def reference_tokens(model: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The same engine in this process: what every multiprocess client must reproduce."""
    client = InprocClient(tiny_config(model))
    try:
        return generate(client, prompts, max_tokens)
    finally:
        client.shutdown()


@dataclass
class BareEngine:
    """An ``engine-core`` process and the three bound sockets a server would own."""

    process: subprocess.Popen[bytes]
    handshake: zmq.Socket
    inputs: zmq.Socket
    outputs: zmq.Socket

    def serve_handshake(self, rank: int = 0) -> None:
        server = HandshakeServer(
            self.handshake, self.inputs, bound_address(self.inputs), bound_address(self.outputs)
        )
        server.wait_for_engine(rank, self.process)


@contextlib.contextmanager
def bare_engine(model: Path, *flags: str) -> Iterator[BareEngine]:
    """Run ``corefleet engine-core`` against sockets the test owns (no client around it)."""
    ctx = zmq.Context()
    handshake, inputs, outputs = (
        make_socket(ctx, kind, "tcp://127.0.0.1:0", bind=True)
        for kind in (zmq.ROUTER, zmq.ROUTER, zmq.PULL)
    )
    argv = [
        sys.executable,
        *(["-P"] if sys.version_info >= (3, 11) else []),
        *("-m", "corefleet.engine.cli", "engine-core"),
        *("--coordinator", bound_address(handshake)),
        *flags,
        *engine_argv_from_config(tiny_config(model)),
    ]
    process = subprocess.Popen(argv)
    try:
        yield BareEngine(process, handshake, inputs, outputs)
    finally:
        process.kill()
        process.wait(timeout=10)
        for sock in (handshake, inputs, outputs):
            sock.close(linger=0)
        ctx.term()


def spawn_rank(
    model: Path,
    handshake: int | str,
    rank: int,
    *flags: str,
    env: dict[str, str] | None = None,
    **engine_args: object,
) -> subprocess.Popen[bytes]:
    """``corefleet engine-core`` for ``rank``, dialling a coordinator's handshake port on
    127.0.0.1, or ``--coordinator handshake`` when it is a string (a list, a name);
    ``engine_args`` go into its ``tiny_config``."""
    coordinator = handshake if isinstance(handshake, str) else f"127.0.0.1:{handshake}"
    argv = [
        sys.executable,
        *(["-P"] if sys.version_info >= (3, 11) else []),
        *("-m", "corefleet.engine.cli", "engine-core"),
        *("--coordinator", coordinator, "--rank", str(rank)),
        *("--health-port", "0", "--shutdown-timeout", "30"),
        *flags,
        *engine_argv_from_config(tiny_config(model, **engine_args)),
    ]
    return subprocess.Popen(argv, env=None if env is None else {**os.environ, **env})


async def until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Wait (asyncio) until ``condition()`` holds; TimeoutError naming ``what`` otherwise."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout} s")
        await asyncio.sleep(0.05)


def run_with_processes(
    scenario: Callable[[list[subprocess.Popen[bytes]]], Coroutine[object, object, T]],
) -> T:
    """Run an asyncio scenario that starts processes into the list it is given; every one of
    them is killed afterwards, whatever happened."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        return asyncio.run(scenario(procs))
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)


@contextlib.asynccontextmanager
async def local_fleet(heartbeat_timeout_s: float | None = None) -> AsyncIterator[FleetClient]:
    """A started coordinator fleet on 127.0.0.1 (free ports, round robin) that ranks from
    :func:`spawn_rank` can join; closed on leaving."""
    options = {} if heartbeat_timeout_s is None else {"heartbeat_timeout_s": heartbeat_timeout_s}
    fleet = FleetClient(
        policy=make_policy("round-robin"),
        bind_host="127.0.0.1",
        advertise_host="127.0.0.1",
        ports=(0, 0, 0),
        **options,
    )
    await fleet.start()
    try:
        yield fleet
    finally:
        await fleet.close()
