"""Starts an engine process for a local client and owns everything that must be cleaned up.

The client binds the three sockets (handshake ROUTER, input ROUTER, output PULL) on loopback,
then runs ``corefleet engine-core --coordinator <handshake address>`` as a child — the very
command a rank pod runs in the cluster — and serves its handshake. The child also gets the read
end of a pipe whose write end only this process holds (``--parent-fd``): if this process dies,
even by SIGKILL, the child sees end of file at once and exits instead of lingering.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field

import zmq
import zmq.auth.thread

from corefleet.engine.config import EngineConfig
from corefleet.engine.engine_args import engine_argv_from_config
from corefleet.engine.messages import ReadyResponse
from corefleet.engine.transport.handshake import HandshakeServer
from corefleet.engine.transport.sockets import (
    bound_address,
    load_curve_keys,
    make_socket,
    start_authenticator,
)

logger = logging.getLogger(__name__)

LOOPBACK = "tcp://127.0.0.1:0"
_KILL_WAIT_S = 5.0


@dataclass
class EngineResources:
    """The engine process and the sockets to it; :meth:`shutdown` is idempotent."""

    ctx: zmq.Context
    sockets: list[zmq.Socket] = field(default_factory=list)
    authenticator: zmq.auth.thread.ThreadAuthenticator | None = None
    process: subprocess.Popen[bytes] | None = None
    # The write end of the engine's parent-death pipe. Closed only once the engine has exited:
    # closing it tells the engine its parent died, which would cut a drain short.
    parent_pipe: int | None = None
    default_timeout_s: float = 30.0
    closing: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def stop_process(self, timeout: float | None = None) -> None:
        """SIGTERM (the engine drains or aborts as configured), then SIGKILL after ``timeout``."""
        proc = self.process
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        wait_s = self.default_timeout_s + _KILL_WAIT_S if timeout is None else timeout
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            logger.warning("engine pid %d still running after %.1f s; killing it", proc.pid, wait_s)
            proc.kill()
            proc.wait(timeout=_KILL_WAIT_S)

    def shutdown(self, timeout: float | None = None) -> None:
        with self._lock:
            if self.closing and not self.sockets:
                return
            self.closing = True
        try:
            self.stop_process(timeout)
        finally:
            self._close_parent_pipe()
        self.close_sockets()

    def _close_parent_pipe(self) -> None:
        with self._lock:
            fd, self.parent_pipe = self.parent_pipe, None
        if fd is not None:
            os.close(fd)

    def close_sockets(self) -> None:
        with self._lock:
            sockets, self.sockets = self.sockets, []
        for sock in sockets:
            sock.close(linger=0)
        if self.authenticator is not None:
            self.authenticator.stop()
            self.authenticator = None
        if not self.ctx.closed:
            self.ctx.term()


@dataclass
class LaunchedEngine:
    resources: EngineResources
    handshake: zmq.Socket
    input: zmq.Socket
    output: zmq.Socket
    info: ReadyResponse

    @property
    def addresses(self) -> dict[str, str]:
        """Where the engine connects: ``handshake``, ``input`` and ``output``."""
        return {
            "handshake": bound_address(self.handshake),
            "input": bound_address(self.input),
            "output": bound_address(self.output),
        }


def launch_engine(
    config: EngineConfig,
    shutdown_mode: str,
    shutdown_timeout_s: float,
    curve_keys_dir: str | None,
    extra_env: dict[str, str],
) -> LaunchedEngine:
    """Bind, spawn rank 0, and wait until it is ready (or raise EngineStartupError)."""
    curve = load_curve_keys("server", curve_keys_dir) if curve_keys_dir else None
    ctx: zmq.Context = zmq.Context()
    resources = EngineResources(ctx, default_timeout_s=shutdown_timeout_s)
    try:
        if curve is not None:
            resources.authenticator = start_authenticator(ctx, curve)
        handshake = make_socket(ctx, zmq.ROUTER, LOOPBACK, bind=True, curve=curve)
        inputs = make_socket(ctx, zmq.ROUTER, LOOPBACK, bind=True, curve=curve)
        outputs = make_socket(ctx, zmq.PULL, LOOPBACK, bind=True, curve=curve)
        resources.sockets += [handshake, inputs, outputs]
        # A ROUTER drops messages to an unknown peer silently; we want to hear about it.
        inputs.setsockopt(zmq.ROUTER_MANDATORY, 1)
        argv = [
            sys.executable,
            # -P: do not put the working directory first on sys.path, where a folder such as
            # this repository's operator/ would shadow a standard-library module.
            *(["-P"] if sys.version_info >= (3, 11) else []),
            "-m",
            "corefleet.engine.cli",
            "engine-core",
            *("--coordinator", bound_address(handshake)),
            *("--rank", "0"),
            *("--parent-pid", str(os.getpid())),
            *("--health-port", "0"),  # the client watches the process itself
            *("--shutdown-mode", shutdown_mode),
            *("--shutdown-timeout", repr(shutdown_timeout_s)),
            *engine_argv_from_config(config),
        ]
        if curve_keys_dir:
            argv += ["--curve-keys-dir", curve_keys_dir]
        env = {**os.environ, **extra_env}
        logger.info("starting the engine core: %s", " ".join(argv[2:]))
        resources.process = _spawn_with_parent_pipe(argv, env, resources)
        server = HandshakeServer(handshake, inputs, bound_address(inputs), bound_address(outputs))
        info = server.wait_for_engine(0, resources.process)
    except BaseException:
        resources.shutdown(timeout=0.0)
        raise
    return LaunchedEngine(resources, handshake, inputs, outputs, info)


def _spawn_with_parent_pipe(
    argv: list[str], env: dict[str, str], resources: EngineResources
) -> subprocess.Popen[bytes]:
    """Start the engine with ``--parent-fd``; the write end goes to ``resources``."""
    read_end, resources.parent_pipe = os.pipe()  # both ends close on exec unless passed
    try:
        return subprocess.Popen(
            [*argv, "--parent-fd", str(read_end)], env=env, pass_fds=(read_end,)
        )
    finally:
        os.close(read_end)  # the child has its own copy; ours would only leak
