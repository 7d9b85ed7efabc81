"""No orphans, no deaf ranks: a rank never outlives the process that started it, and SIGTERM
works in every state.

Real processes and real signals. To kill a rank's parent, the test starts a small Python parent
(through the real ``LocalRanks`` or ``SyncMPClient``) that starts the rank and prints its pid;
the test itself plays the coordinator where one is needed. How fast a rank exits is measured
separately, not asserted: every wait here is a generous poll, never a bound.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgspec
import psutil
import pytest
import zmq

from corefleet.engine.config import EngineConfig
from corefleet.engine.entrypoints.local_ranks import LocalRanks
from corefleet.engine.messages import HandshakeMessage, Hello, Init, Ready
from corefleet.engine.transport.sockets import bound_address, make_socket
from tests.engine_faults import PID_FILE_ENV
from tests.engine_proc_support import child_env
from tests.fixtures_models import write_tiny_llama
from tests.serve_support import free_port

pytestmark = pytest.mark.slow

TIMEOUT_S = 120.0  # for every wait: generous, so that a loaded 2-core machine passes too
ENGINE_FLAGS = ("--dtype", "float32", "--kv-cache-memory", str(8 << 20), "--block-size", "4")

# A parent that starts one rank the way ``corefleet serve`` does, prints its pid, and waits.
LOCAL_RANKS_PARENT = """
import sys, time
from corefleet.engine.config import EngineConfig
from corefleet.engine.entrypoints.local_ranks import LocalRanks
model, port, *backend = sys.argv[1:]
options = {"distributed_executor_backend": backend[0]} if backend else {}
config = EngineConfig.from_kwargs(
    model=model, dtype="float32", kv_cache_memory=8 << 20, block_size=4, **options
)
ranks = LocalRanks(config, 1, "drain", 30.0)
ranks.start(int(port))
print(ranks.procs[0].pid, flush=True)
time.sleep(600)
"""

# A parent that is a multiprocess client of a ready (serving) engine, prints its pid, and waits.
CLIENT_PARENT = """
import sys, time
from corefleet.engine.client.base import MPClientOptions
from corefleet.engine.client.mp import SyncMPClient
from corefleet.engine.config import EngineConfig
config = EngineConfig.from_kwargs(
    model=sys.argv[1], dtype="float32", kv_cache_memory=8 << 20, block_size=4
)
client = SyncMPClient(config, MPClientOptions())
print(client.engine_pid, flush=True)
time.sleep(600)
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "m")


# ---- processes ---------------------------------------------------------------------------------


def wait_until(condition: Callable[[], bool], what: str, timeout: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout} s")
        time.sleep(0.05)


def gone(proc: psutil.Process) -> bool:
    """Exited; a zombie counts (a PID 1 that does not reap keeps reparented ones as zombies)."""
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def kill_quietly(proc: psutil.Process) -> None:
    with contextlib.suppress(psutil.NoSuchProcess):
        proc.kill()


@dataclass
class Parent:
    """An intermediate parent process and the rank it started."""

    process: subprocess.Popen[str]
    rank: psutil.Process


@contextlib.contextmanager
def parent_of_a_rank(
    script: str, *args: str, env: dict[str, str] | None = None
) -> Iterator[Parent]:
    """Run ``script`` (which prints its rank's pid); both are killed on leaving."""
    process = subprocess.Popen(
        [sys.executable, "-P", "-c", script, *args],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    rank: psutil.Process | None = None
    try:
        rank = psutil.Process(int(_read_line(process, TIMEOUT_S)))
        yield Parent(process, rank)
    finally:
        process.kill()
        process.wait(timeout=10)
        assert process.stdout is not None
        process.stdout.close()
        if rank is not None:
            kill_quietly(rank)


def _read_line(process: subprocess.Popen[str], timeout: float) -> str:
    assert process.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        if not selector.select(timeout):
            raise TimeoutError(f"the parent printed no rank pid within {timeout} s")
    line = process.stdout.readline().strip()
    assert line, f"the parent exited with {process.wait(timeout=10)} before starting a rank"
    return line


def kill_parent_and_wait_for_the_rank(parent: Parent) -> None:
    parent.process.send_signal(signal.SIGKILL)
    parent.process.wait(timeout=10)
    wait_until(lambda: gone(parent.rank), "the rank exits after its parent's SIGKILL")


@contextlib.contextmanager
def local_rank(tiny: Path, port: int) -> Iterator[subprocess.Popen[bytes]]:
    """One rank started by this process through the real LocalRanks; killed on leaving."""
    config = EngineConfig.from_kwargs(
        model=str(tiny), dtype="float32", kv_cache_memory=8 << 20, block_size=4
    )
    ranks = LocalRanks(config, 1, "drain", 30.0)
    ranks.start(port)
    assert ranks.procs is not None
    try:
        yield ranks.procs[0]
    finally:
        ranks.procs[0].kill()
        ranks.stop()  # reaps it and closes the parent pipe


# ---- the coordinator's side, played by the test -------------------------------------------------


@dataclass
class Coordinator:
    """The three sockets a coordinator binds; HELLOs are answered only when asked to."""

    handshake: zmq.Socket
    inputs: zmq.Socket
    outputs: zmq.Socket

    @property
    def port(self) -> int:
        return int(bound_address(self.handshake).rsplit(":", 1)[1])

    def next_hello(self) -> bytes:
        """Wait for a rank's HELLO (it then waits for INIT), leave it unanswered; its identity."""
        identity, payload = receive(self.handshake, "a HELLO")
        assert isinstance(msgspec.msgpack.decode(payload, type=HandshakeMessage), Hello)
        return identity

    def send_init(self, identity: bytes) -> None:
        init = Init(bound_address(self.inputs), bound_address(self.outputs), engine_index=0)
        self.handshake.send_multipart([identity, msgspec.msgpack.encode(init)])

    def serve(self) -> None:
        """Run a rank's whole handshake: it serves afterwards."""
        self.send_init(self.next_hello())
        receive(self.inputs, "the ready response")  # the first message on its input socket
        _, payload = receive(self.handshake, "READY")
        assert isinstance(msgspec.msgpack.decode(payload, type=HandshakeMessage), Ready)

    def vanish(self) -> None:
        """Drop the rank's input connection, as a restarting coordinator does; the rank then
        says HELLO again on the handshake socket, which stays ours."""
        self.inputs.close(linger=0)


def receive(sock: zmq.Socket, what: str) -> list[bytes]:
    assert sock.poll(int(TIMEOUT_S * 1000)), f"no {what} within {TIMEOUT_S} s"
    return sock.recv_multipart()


@contextlib.contextmanager
def coordinator() -> Iterator[Coordinator]:
    ctx = zmq.Context()
    socks = [
        make_socket(ctx, kind, "tcp://127.0.0.1:0", bind=True)
        for kind in (zmq.ROUTER, zmq.ROUTER, zmq.PULL)
    ]
    try:
        yield Coordinator(*socks)
    finally:
        for sock in socks:
            sock.close(linger=0)
        ctx.term()


# ---- parent killed: the rank exits, whatever its state ----------------------------------------


def test_rank_exits_when_its_parent_dies_while_it_waits_for_init(tiny: Path) -> None:
    with (
        coordinator() as coord,
        parent_of_a_rank(LOCAL_RANKS_PARENT, str(tiny), str(coord.port)) as parent,
    ):
        coord.next_hello()  # nobody answers
        kill_parent_and_wait_for_the_rank(parent)


def test_rank_exits_when_its_parent_dies_while_it_loads_the_model(
    tiny: Path, tmp_path: Path
) -> None:
    pid_file = tmp_path / "loading.pid"
    env = {**dict(child_env(tmp_path)), PID_FILE_ENV: str(pid_file)}
    slow_start = "tests.engine_faults:SlowStartExecutor"  # "loads" for a minute
    with coordinator() as coord:
        args = (str(tiny), str(coord.port), slow_start)
        with parent_of_a_rank(LOCAL_RANKS_PARENT, *args, env=env) as parent:
            coord.send_init(coord.next_hello())
            wait_until(pid_file.exists, "the rank starts loading")
            kill_parent_and_wait_for_the_rank(parent)
            # It left while loading: it never sent the ready response that follows the load.
            assert not coord.inputs.poll(0)


def test_rank_exits_when_its_parent_dies_while_it_serves(tiny: Path) -> None:
    # The parent is a multiprocess client: this also covers launch_engine's parent pipe.
    with parent_of_a_rank(CLIENT_PARENT, str(tiny)) as parent:
        kill_parent_and_wait_for_the_rank(parent)


def test_rank_exits_when_its_parent_dies_while_it_handshakes_again(tiny: Path) -> None:
    with (
        coordinator() as coord,
        parent_of_a_rank(LOCAL_RANKS_PARENT, str(tiny), str(coord.port)) as parent,
    ):
        coord.serve()
        coord.vanish()
        coord.next_hello()  # the rank lost its coordinator and waits for INIT again
        kill_parent_and_wait_for_the_rank(parent)


# ---- SIGTERM while waiting for INIT: exit 0 at once ---------------------------------------------


def test_sigterm_while_waiting_for_init_at_start_exits_0(tiny: Path) -> None:
    with coordinator() as coord, local_rank(tiny, coord.port) as rank:
        coord.next_hello()
        rank.send_signal(signal.SIGTERM)
        assert rank.wait(timeout=TIMEOUT_S) == 0


def test_sigterm_while_handshaking_again_exits_0(tiny: Path) -> None:
    with coordinator() as coord, local_rank(tiny, coord.port) as rank:
        coord.serve()
        coord.vanish()
        coord.next_hello()
        rank.send_signal(signal.SIGTERM)
        assert rank.wait(timeout=TIMEOUT_S) == 0


# ---- corefleet serve killed with SIGKILL ---------------------------------------------------------


def test_serve_killed_by_sigkill_leaves_no_rank_behind(tiny: Path) -> None:
    port = free_port()
    argv = [
        sys.executable,
        "-P",
        *("-m", "corefleet.engine.cli", "serve", "--port", str(port), "--model", str(tiny)),
        *("--data-parallel-size", "2", "--max-model-len", "64", *ENGINE_FLAGS),
    ]
    serve = subprocess.Popen(argv)
    ranks: list[psutil.Process] = []
    try:
        wait_until(lambda: _ready(serve, f"http://127.0.0.1:{port}/ready"), "serve is ready")
        ranks = [
            child
            for child in psutil.Process(serve.pid).children(recursive=True)
            if "engine-core" in child.cmdline()
        ]
        assert len(ranks) == 2
        serve.send_signal(signal.SIGKILL)
        serve.wait(timeout=10)
        wait_until(lambda: all(gone(rank) for rank in ranks), "every rank exits after serve")
    finally:
        serve.kill()
        serve.wait(timeout=10)
        for rank in ranks:
            kill_quietly(rank)


def _ready(serve: subprocess.Popen[bytes], url: str) -> bool:
    assert serve.poll() is None, f"corefleet serve exited with {serve.returncode}"
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url, timeout=1).status_code == 200
    return False
