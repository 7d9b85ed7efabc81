"""``corefleet serve --api-server-count 2``: two API processes on one port, both serving the
same rank; SIGKILL of one ends its own streams at once and leaves the other serving."""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engine_proc_support import child_env
from tests.fixtures_models import write_tiny_llama
from tests.serve_support import free_port, wait_serve_ready

pytestmark = pytest.mark.slow

TIMEOUT_S = 120.0  # generous: a loaded 2-core machine must pass too
# No model work, 10 ms a step whatever the machine: a stream lasts seconds.
SLOW = ("--distributed-executor-backend", "tests.engine_faults:SlowNullExecutor")
ENGINE_FLAGS = ("--dtype", "float32", "--kv-cache-memory", str(8 << 20), "--block-size", "4")
STREAM_TOKENS = 200  # 2 s or more at 10 ms a step; the tiny model holds 256 tokens


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as f:
        return [int(p) for p in f.read().split()]


def _children_running(serve_pid: int, *words: bytes) -> set[int]:
    """``serve``'s children whose command line holds ``words``, in order."""
    found = set()
    for child in _children(serve_pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"\0".join(words) in f.read():
                    found.add(child)
        except FileNotFoundError:
            continue
    return found


def _api_pids(serve_pid: int) -> set[int]:
    """The API processes among ``serve``'s children (the ranks run ``engine-core``)."""
    return _children_running(serve_pid, b"corefleet.engine.entrypoints.api_servers")


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def _server_pid(conn: http.client.HTTPConnection, http_port: int, pids: set[int]) -> int | None:
    """Which of ``pids`` accepted ``conn``: its server-side socket in /proc/net/tcp, by inode."""
    assert conn.sock is not None
    client_port = conn.sock.getsockname()[1]
    inode = None
    with open("/proc/net/tcp", encoding="ascii") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            local_port = int(fields[1].split(":")[1], 16)
            remote_port = int(fields[2].split(":")[1], 16)
            if local_port == http_port and remote_port == client_port:
                inode = fields[9]
    if inode is None:
        return None
    return next((pid for pid in pids if inode in _socket_inodes(pid)), None)


def _poll(what: str, probe: object) -> object:
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        value = probe()  # type: ignore[operator]
        if value:
            return value
        assert time.monotonic() < deadline, f"{what}: not within {TIMEOUT_S} s"
        time.sleep(0.1)


def _connection_to(pid: int, port: int, pids: set[int]) -> http.client.HTTPConnection:
    """A new keep-alive connection that process ``pid`` accepted (new ones until one is)."""

    def attempt() -> http.client.HTTPConnection | None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
        conn.connect()
        # The accept happens in the server's event loop: wait for its side to exist.
        owner = _poll("the server side of a connection", lambda: _server_pid(conn, port, pids))
        if owner == pid:
            return conn
        conn.close()
        return None

    return _poll(f"a connection accepted by {pid}", attempt)  # type: ignore[return-value]


def _stream(conn: http.client.HTTPConnection, max_tokens: int) -> Iterator[dict | str]:
    """A streamed completion on ``conn``: its SSE events, decoded, then ``"[DONE]"`` if the
    stream ended properly."""
    body = {
        "prompt": "hello there",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        # The null executor's token is a special one: shown, every token is its own chunk.
        "skip_special_tokens": False,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200, response.read()
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            yield "[DONE]"
            return
        yield json.loads(line[len("data: ") :])


def _get_json(conn: http.client.HTTPConnection, path: str) -> object:
    conn.request("GET", path)
    response = conn.getresponse()
    return json.loads(response.read())


def _complete(conn: http.client.HTTPConnection) -> int:
    body = json.dumps({"prompt": "hi", "max_tokens": 3, "ignore_eos": True})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    response.read()
    return response.status


def _start_serve(tmp_path: Path, *flags: str) -> tuple[subprocess.Popen[bytes], int, Path]:
    model = write_tiny_llama(tmp_path / "m")
    port = free_port()
    log = tmp_path / "serve.log"
    argv = [
        sys.executable,
        *(["-P"] if sys.version_info >= (3, 11) else []),
        *("-m", "corefleet.engine.cli", "serve", "--port", str(port), "--model", str(model)),
        *flags,
        *SLOW,
        *ENGINE_FLAGS,
    ]
    env = {**os.environ, **dict(child_env(tmp_path))}
    with log.open("wb") as out:
        serve = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    wait_serve_ready(serve, f"http://127.0.0.1:{port}", TIMEOUT_S, log)
    return serve, port, log


def test_two_api_processes_share_the_port_and_survive_each_other(tmp_path: Path) -> None:
    serve, port, log = _start_serve(
        tmp_path, "--api-server-count", "2", "--data-parallel-size", "1"
    )
    try:
        pids = _poll(
            "two API processes", lambda: len(_api_pids(serve.pid)) == 2 and _api_pids(serve.pid)
        )
        first, second = sorted(pids)  # type: ignore[call-overload]

        # Both processes take requests: a stream on a connection each, both under way.
        streams = {
            pid: _stream(_connection_to(pid, port, pids), STREAM_TOKENS) for pid in (first, second)
        }
        for events in streams.values():
            head = next(events)  # the first token (each process numbers its own requests)
            assert isinstance(head, dict) and head["choices"][0]["text"], head

        # SIGKILL one: its stream is cut at once (no hang, no end marker, no finish reason;
        # a client library reports the truncated body), the other's runs to the end.
        os.kill(first, signal.SIGKILL)
        cut: list[dict | str] = []
        with contextlib.suppress(http.client.IncompleteRead, ConnectionError):
            cut.extend(streams[first])
        assert "[DONE]" not in cut, json.dumps(cut)
        assert all(isinstance(e, dict) and not e["choices"][0].get("finish_reason") for e in cut)
        rest = list(streams[second])
        assert rest[-1] == "[DONE]"
        usage = rest[-2]["usage"]  # type: ignore[index]
        assert usage["completion_tokens"] == STREAM_TOKENS, json.dumps(rest)[-3000:]
        finishes = [e["choices"][0].get("finish_reason") for e in rest[:-2]]  # type: ignore[union-attr]
        assert finishes[-1] == "length" and not any(finishes[:-1])

        # New connections go to the survivor at once, and every request succeeds.
        for _ in range(5):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
            assert _complete(conn) == 200
            conn.close()

        # The killed process is started again, the rank joins it, and it serves.
        restarted = _poll("a restarted API process", lambda: _api_pids(serve.pid) - {second})
        (new_pid,) = restarted  # type: ignore[misc]
        assert new_pid != first
        conn = _connection_to(new_pid, port, {second, new_pid})
        assert _complete(conn) == 200
        conn.close()

        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=TIMEOUT_S) == 0, log.read_text()
        for pid in (second, new_pid):  # stopped and reaped by serve before it exited
            assert not Path(f"/proc/{pid}").exists()
    finally:
        serve.kill()
        serve.wait(timeout=10)


def _tokens_of(events: list[dict | str]) -> int:
    assert events[-1] == "[DONE]", events[-3:]
    return int(events[-2]["usage"]["completion_tokens"])  # type: ignore[index]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["drain", "death"])
def test_a_rank_leaving_under_load_from_two_api_processes_fails_nothing(
    tmp_path: Path, sig: signal.Signals
) -> None:
    """SIGTERM: the rank drains (finishes its streams, refuses new ones: each coordinator
    routes its own elsewhere). SIGKILL: each coordinator migrates its own streams."""
    serve, port, log = _start_serve(
        tmp_path, "--api-server-count", "2", "--data-parallel-size", "2"
    )
    try:
        pids: set[int] = _poll("two API processes", lambda: _both_api_pids(serve.pid))  # type: ignore[assignment]

        def engines(pid: int) -> list[dict]:
            conn = _connection_to(pid, port, pids)
            try:
                return _get_json(conn, "/admin/engines")  # type: ignore[return-value]
            finally:
                conn.close()

        for pid in pids:
            _poll(
                f"{pid} sees both ranks",
                lambda p=pid: [e["state"] for e in engines(p)] == ["ready"] * 2,
            )
        (rank1,) = _children_running(serve.pid, b"--rank", b"1")

        with concurrent.futures.ThreadPoolExecutor(16) as pool:

            def streams(per_process: int) -> list[concurrent.futures.Future[list[dict | str]]]:
                conns = [
                    _connection_to(p, port, pids) for p in sorted(pids) for _ in range(per_process)
                ]
                return [pool.submit(lambda c=c: list(_stream(c, STREAM_TOKENS))) for c in conns]

            running = streams(4)  # 8 streams, 4 through each process, spread over both ranks
            some = sorted(pids)[0]
            _poll("rank 1 busy", lambda: _running(engines(some), rank=1) > 0)
            os.kill(rank1, sig)
            arriving = streams(4)  # sent while it leaves: refused there or routed to rank 0
            outcomes = [f.result(timeout=TIMEOUT_S) for f in running + arriving]
        assert [_tokens_of(events) for events in outcomes] == [STREAM_TOKENS] * 16
        if sig == signal.SIGKILL:  # the streams on rank 1 moved, each by its own coordinator
            assert sum(_migrations(_connection_to(p, port, pids)) for p in pids) > 0
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            assert serve.wait(timeout=TIMEOUT_S) == 0, log.read_text()
        finally:
            serve.kill()
            serve.wait(timeout=10)


def _migrations(conn: http.client.HTTPConnection) -> float:
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    (line,) = [x for x in text.splitlines() if x.startswith("corefleet_migrations_total ")]
    return float(line.split()[1])


def _running(engines: list[dict], rank: int) -> int:
    (entry,) = [e for e in engines if e["rank"] == rank]
    return int(entry["stats"]["running"]) if entry["stats"] else 0


def _both_api_pids(serve_pid: int) -> set[int] | None:
    pids = _api_pids(serve_pid)
    return pids if len(pids) == 2 else None


@pytest.mark.parametrize("count", ["0", "65", str(2**31)])
def test_an_absurd_api_server_count_is_refused_before_anything_starts(count: str) -> None:
    argv = [sys.executable, "-m", "corefleet.engine.cli", "serve", "--api-server-count", count]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 2
    assert f"--api-server-count {count} must be between 1 and 64" in done.stderr
