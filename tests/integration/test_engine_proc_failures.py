"""Engine processes that are told to stop, die, fail to start, or meet strangers.

Real processes, real signals, real sockets: SIGTERM drain and abort, SIGKILL, an exception inside
``execute_model``, a child killed while loading, and CURVE refusing unauthenticated peers.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zmq

from corefleet.engine.client.base import EngineDeadError, MPClientOptions
from corefleet.engine.client.mp import SyncMPClient
from corefleet.engine.messages import (
    PROTOCOL_VERSION,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    Hello,
)
from corefleet.engine.transport.handshake import EngineStartupError
from corefleet.engine.transport.serial import MsgpackEncoder
from tests.engine_faults import PID_FILE_ENV
from tests.engine_proc_support import (
    PROMPTS,
    bare_engine,
    child_env,
    collect,
    generate,
    greedy,
    reference_tokens,
    tiny_config,
)
from tests.fixtures_models import write_tiny_llama

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "m")


SLOW = "tests.engine_faults:SlowNullExecutor"  # 10 ms per step, whatever the machine


def _start_slow(tiny: Path, folder: Path, **options: Any) -> SyncMPClient:
    """An engine whose steps take 10 ms, so "in flight" lasts as long as a test needs."""
    engine_args = {"distributed_executor_backend": SLOW, **options.pop("engine_args", {})}
    return _start(tiny, extra_env=child_env(folder), engine_args=engine_args, **options)


def _start(tiny: Path, **options: Any) -> SyncMPClient:
    engine_args = options.pop("engine_args", {})
    return SyncMPClient(tiny_config(tiny, **engine_args), MPClientOptions(**options))


def _pid(client: SyncMPClient) -> int:
    assert client.resources.process is not None
    return client.resources.process.pid


def _wait_for(condition: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {timeout} s")
        time.sleep(0.02)


def _start_in_flight(client: SyncMPClient, n: int, max_tokens: int) -> dict[str, list[int]]:
    """Add ``n`` requests and return once each has produced a token."""
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(n)}
    for i, request_id in enumerate(tokens):
        client.add_request(EngineCoreRequest(request_id, PROMPTS[i % 4], greedy(max_tokens)))
    while not all(tokens.values()):
        for out in client.get_output(10).outputs:
            tokens[out.request_id] += out.new_token_ids
    return tokens


def test_sigterm_drain_finishes_in_flight_requests_and_refuses_new_ones(
    tiny: Path, tmp_path: Path
) -> None:
    client = _start_slow(tiny, tmp_path, shutdown_mode="drain", shutdown_timeout_s=60)
    try:
        early = _start_in_flight(client, 4, max_tokens=150)
        os.kill(_pid(client), signal.SIGTERM)
        _wait_for(lambda: client.engine_stats is not None and client.engine_stats.draining, 5)
        client.add_request(EngineCoreRequest("late", PROMPTS[0], greedy(5)))
        with pytest.raises(RuntimeError, match="shutting down"):
            client.call_utility("get_num_unfinished_requests")
        results = collect(client, {*early, "late"})
        assert results["late"].reason is FinishReason.REJECTED and results["late"].tokens == []
        for request_id, first in early.items():
            assert results[request_id].reason is FinishReason.LENGTH
            assert len(first + results[request_id].tokens) == 150
        assert client.resources.process is not None
        assert client.resources.process.wait(timeout=30) == 0
    finally:
        client.shutdown()


def test_sigterm_abort_finishes_everything_with_abort(tiny: Path, tmp_path: Path) -> None:
    client = _start_slow(tiny, tmp_path, shutdown_mode="abort")
    try:
        in_flight = _start_in_flight(client, 4, max_tokens=200)
        os.kill(_pid(client), signal.SIGTERM)
        # 200 tokens at 10 ms a step each: ABORT, not LENGTH, shows they were cut at once.
        results = collect(client, set(in_flight), timeout=30)
        assert all(r.reason is FinishReason.ABORT for r in results.values())
        assert client.resources.process is not None
        assert client.resources.process.wait(timeout=10) == 0
    finally:
        client.shutdown()


def test_drain_timeout_aborts_what_is_left_and_exits(tiny: Path, tmp_path: Path) -> None:
    # One request at a time, 32 of 250 tokens at 10 ms a step: far more than a 1 s drain.
    client = _start_slow(
        tiny,
        tmp_path,
        shutdown_mode="drain",
        shutdown_timeout_s=1.0,
        engine_args={"max_num_seqs": 1},
    )
    try:
        ids = [f"q{i}" for i in range(32)]
        for request_id in ids:
            client.add_request(EngineCoreRequest(request_id, PROMPTS[0], greedy(250)))
        while not client.get_output(10).outputs:
            pass  # the first request is running
        signalled = time.monotonic()
        os.kill(_pid(client), signal.SIGTERM)
        results = collect(client, set(ids), timeout=20)
        assert time.monotonic() - signalled > 0.9  # it drained for its 1 s first
        reasons = [results[i].reason for i in ids]
        assert set(reasons) <= {FinishReason.LENGTH, FinishReason.ABORT}
        assert reasons[-1] is FinishReason.ABORT  # the queue was cut, not served
        assert client.resources.process is not None
        assert client.resources.process.wait(timeout=10) == 0
    finally:
        client.shutdown()


def test_a_silent_engine_is_declared_dead_after_the_heartbeat_timeout(tiny: Path) -> None:
    client = _start(tiny, heartbeat_timeout_s=1.5)
    try:
        client.add_request(EngineCoreRequest("frozen", PROMPTS[0], greedy(200)))
        os.kill(_pid(client), signal.SIGSTOP)  # alive, but says nothing: no stats, no outputs
        stopped = time.monotonic()
        with pytest.raises(EngineDeadError, match="no message from the engine core"):
            collect(client, {"frozen"}, timeout=10)
        # Not before the timeout (silence counts from the last message, which can precede the
        # stop by one stats interval).
        assert time.monotonic() - stopped >= 1.0
    finally:
        os.kill(_pid(client), signal.SIGCONT)
        client.shutdown()


def _wait_blocked_in(thread: threading.Thread, function: str, timeout: float = 30.0) -> None:
    """Poll the thread's stack until `function` is on it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        frame = sys._current_frames().get(thread.ident or -1)
        while frame is not None:
            if frame.f_code.co_name == function:
                return
            frame = frame.f_back
        time.sleep(0.01)
    raise AssertionError(f"{thread.name} never blocked in {function}")


def test_sigkill_fails_every_pending_call_with_engine_dead(tiny: Path, tmp_path: Path) -> None:
    client = _start_slow(tiny, tmp_path)
    errors: list[BaseException] = []

    def call(fn: Callable[[], object]) -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)

    try:
        for i in range(32):  # enough work that nothing finishes before the kill
            client.add_request(EngineCoreRequest(f"long{i}", PROMPTS[i % 4], greedy(220)))
        # A waiting utility call (its reply is deferred until idle) and a waiting reader.
        waiters = [
            threading.Thread(target=call, args=(lambda: client.call_utility("wait_until_idle"),)),
            threading.Thread(target=call, args=(lambda: collect(client, {"never"}, 30),)),
        ]
        for waiter in waiters:
            waiter.start()
        # Both calls must be pending when the engine dies, not made after: wait until each
        # waiter is blocked inside its call.
        for waiter, inside in zip(waiters, ("call_utility", "get_output"), strict=True):
            _wait_blocked_in(waiter, inside)
        assert client.call_utility("get_num_unfinished_requests") == 32
        os.kill(_pid(client), signal.SIGKILL)
        for waiter in waiters:  # the reader alone would wait 30 s for its request
            waiter.join(timeout=25)
        assert not any(waiter.is_alive() for waiter in waiters)
        assert len(errors) == 2 and all(isinstance(e, EngineDeadError) for e in errors)
        assert "SIGKILL" in str(errors[0])
        with pytest.raises(EngineDeadError):
            client.add_request(EngineCoreRequest("after", PROMPTS[0], greedy(2)))
        client.abort_requests(["long0"])  # a no-op once dead, not an error
    finally:
        client.shutdown()
        client.shutdown()  # idempotent


def test_exception_inside_execute_model_reaches_the_client_as_engine_dead(
    tiny: Path, tmp_path: Path
) -> None:
    client = _start(
        tiny,
        extra_env=child_env(tmp_path),
        engine_args={"distributed_executor_backend": "tests.engine_faults:FailingExecutor"},
    )
    try:
        client.add_request(EngineCoreRequest("doomed", PROMPTS[0], greedy(50)))
        # The reason travels with ENGINE_CORE_DEAD: the client can say what failed.
        with pytest.raises(
            EngineDeadError, match=r"ENGINE_CORE_DEAD.*injected failure inside execute_model"
        ):
            collect(client, {"doomed"}, timeout=30)
        assert client.resources.process is not None
        assert client.resources.process.wait(timeout=10) == 1
    finally:
        client.shutdown()


def test_child_killed_while_loading_fails_fast_naming_rank_and_exit(
    tiny: Path, tmp_path: Path
) -> None:
    pid_file = tmp_path / "pid"
    outcome: list[BaseException] = []

    def start() -> None:
        try:
            _start(
                tiny,
                extra_env=(*child_env(tmp_path), (PID_FILE_ENV, str(pid_file))),
                engine_args={
                    "distributed_executor_backend": "tests.engine_faults:SlowStartExecutor"
                },
            ).shutdown()
        except BaseException as exc:
            outcome.append(exc)

    starter = threading.Thread(target=start)
    starter.start()
    _wait_for(lambda: pid_file.exists() and pid_file.read_text() != "", 60)
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    starter.join(timeout=45)  # not the start-up timeout: the death itself ends the wait
    assert not starter.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], EngineStartupError)
    message = str(outcome[0])
    assert "rank 0" in message and "SIGKILL" in message and "loading the model" in message


def test_child_failing_to_start_reports_its_exit_code(tiny: Path) -> None:
    with pytest.raises(EngineStartupError, match=r"rank 0 .* exited with code 1"):
        _start(tiny, engine_args={"distributed_executor_backend": "no_such_module:Executor"})


def _write_keys(folder: Path) -> None:
    folder.mkdir()
    for side in ("server", "client"):
        public, secret = zmq.curve_keypair()
        (folder / f"{side}-public").write_bytes(public + b"\n")
        (folder / f"{side}-secret").write_bytes(secret + b"\n")


def test_curve_admits_the_engine_and_nobody_else(tiny: Path, tmp_path: Path) -> None:
    keys = tmp_path / "curve"
    _write_keys(keys)
    expected = reference_tokens(tiny, PROMPTS[:2], 10)
    client = _start(tiny, curve_keys_dir=str(keys))
    ctx = zmq.Context()
    rogues: list[zmq.Socket] = []
    try:
        # Forged outputs for a live request, from a peer without keys and one with its own keys.
        forged = MsgpackEncoder().encode(
            EngineCoreOutputs(
                outputs=[EngineCoreOutput("victim", [1], finish_reason=FinishReason.STOP)]
            )
        )
        for curve in (False, True):
            rogue = ctx.socket(zmq.PUSH)
            rogue.setsockopt(zmq.LINGER, 0)
            if curve:
                public, secret = zmq.curve_keypair()
                rogue.curve_publickey, rogue.curve_secretkey = public, secret
                rogue.curve_serverkey = (keys / "server-public").read_bytes().strip()
            rogue.connect(client.addresses["output"])
            rogues.append(rogue)
        hello = ctx.socket(zmq.DEALER)
        hello.setsockopt(zmq.LINGER, 0)
        hello.setsockopt(zmq.IDENTITY, (0).to_bytes(2, "little"))
        hello.connect(client.addresses["handshake"])
        rogues.append(hello)

        client.add_request(EngineCoreRequest("victim", PROMPTS[0], greedy(40)))
        for rogue in rogues[:2]:
            for _ in range(5):
                rogue.send_multipart(forged)
        hello.send(MsgpackEncoder().encode(Hello(rank=0, protocol_version=PROTOCOL_VERSION))[0])
        victim = collect(client, {"victim"}, timeout=30)["victim"]
        assert victim.reason is FinishReason.LENGTH and len(victim.tokens) == 40
        assert not hello.poll(1500), "the handshake server answered an unauthenticated peer"
        assert generate(client, PROMPTS[:2], 10) == expected
    finally:
        for rogue in rogues:
            rogue.close()
        ctx.term()
        client.shutdown()


def test_engine_whose_parent_is_gone_exits_by_itself(tiny: Path) -> None:
    # PID 1 is not our parent: the engine must conclude its parent died and exit, without
    # waiting for a handshake (tests/integration/test_engine_orphans.py covers every state).
    with bare_engine(tiny, "--parent-pid", "1", "--health-port", "0") as engine:
        assert engine.process.wait(timeout=60) == 0


@pytest.mark.parametrize("client", ["sync", "async"])
def test_a_script_that_never_calls_shutdown_exits_cleanly(
    tiny: Path, tmp_path: Path, client: str
) -> None:
    """Python's exit closes the client's sockets under its reader: no traceback, no engine
    left behind."""
    pid_file = tmp_path / "engine.pid"
    use = {
        "sync": "llm = LLM(model, max_model_len=128, num_blocks_override=64)\n"
        "outs = llm.generate([{'prompt_token_ids': [5, 6, 7]}], SamplingParams(max_tokens=3))\n"
        "print(outs[0].outputs[0].token_ids)\n"
        "pid = llm.engine_client.engine_pid\n",
        "async": "from corefleet.engine.client.base import MPClientOptions\n"
        "from corefleet.engine.client.mp import AsyncMPClient\n"
        "from tests.engine_proc_support import tiny_config\n"
        "import asyncio, pathlib\n"
        "c = AsyncMPClient(tiny_config(pathlib.Path(model)), MPClientOptions())\n"
        "async def main():\n"
        "    print(await c.call_utility_async('get_num_unfinished_requests'))\n"
        "asyncio.run(main())\n"
        "pid = c.engine_pid\n",
    }[client]
    script = (
        "import sys\n"
        "from corefleet.engine import LLM, SamplingParams\n"
        f"model = {str(tiny)!r}\n" + use + f"open({str(pid_file)!r}, 'w').write(str(pid))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "Exception" not in done.stderr, done.stderr
    engine_pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(engine_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(engine_pid), "the engine outlived the script"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
