"""``corefleet serve --api-server-count N``: N coordinator processes in front of the same ranks.

One coordinator process is bound by its Python: about 3,000 short requests a second on a core
(``benchmarks/README.md``, coordinator.py). With N > 1, ``serve`` runs no API itself; it
supervises:

- **N API processes** (``python -m corefleet.engine.entrypoints.api_servers``), each a whole
  coordinator (HTTP API, routing, membership, its own ZMQ sockets on its own handshake port).
  They share one listening HTTP socket, opened here and inherited: the kernel hands each new
  connection to whichever process accepts first, and when one dies its queued connections stay
  in the shared queue for the others (``SO_REUSEPORT`` would give each process its own queue,
  and a dead one's queued connections would be reset). Each gets its options as JSON on its
  standard input, so API keys never appear in a process list.
- **the ranks**, started with ``--coordinator`` listing every API process's handshake port: each
  rank joins every coordinator (``engine_core/links.py``), so any of them can route to any
  rank, and one that dies takes only its own streams with it. The coordinators never talk to
  each other; each routes on the ranks' own stats, which reach all of them.

An API process that dies is started again (the same back-off as ranks, ``respawn.py``) on the
same socket and handshake port, and the ranks join it again within a couple of seconds; it
accepts connections only once a rank has joined it (or after 30 s), so a client never meets
the restarted process's "no rank ready" 503 while its neighbours serve. Every
child gets the read end of a pipe only this process writes to, so none outlives it.
SIGTERM/SIGINT: the API processes stop accepting and finish their streams within
``--shutdown-timeout`` (SIGTERM to each), then the ranks drain, then this process exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field, replace

import msgspec

from corefleet.engine import envs
from corefleet.engine.entrypoints import event_loop
from corefleet.engine.entrypoints.coordinator import CoordinatorOptions, run
from corefleet.engine.entrypoints.local_ranks import LocalRanks
from corefleet.engine.entrypoints.respawn import Respawner

logger = logging.getLogger(__name__)


class ApiProcessSpec(msgspec.Struct, frozen=True):
    """What one API process is told on its standard input."""

    index: int
    options: CoordinatorOptions
    listen_fd: int  # the shared HTTP socket
    parent_fd: int  # end of file: the supervisor died


def _free_loopback_port() -> int:
    # Bound and released here, bound again by the child a moment later: another process could
    # take it in between, which on a machine running `serve` is unlikely; the child then fails
    # to start with "address in use" in its log and is retried on the same port.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _listening_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


@dataclass
class LocalApiServers:
    """``serve``'s N API processes over one shared HTTP socket."""

    options: CoordinatorOptions  # each process's, but for its handshake port
    count: int
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    handshake_ports: list[int] = field(default_factory=list)
    respawner: Respawner | None = None
    _listener: socket.socket | None = field(default=None, repr=False)
    _pipe: tuple[int, int] | None = field(default=None, repr=False)  # (read end, write end)

    def start(self) -> None:
        """Open the HTTP socket and start the API processes."""
        self._listener = _listening_socket(self.options.host, self.options.port)
        self._pipe = os.pipe()
        self.handshake_ports = [_free_loopback_port() for _ in range(self.count)]
        self.procs = [self._spawn(index) for index in range(self.count)]
        self.respawner = Respawner("API server", self.procs, self._spawn)

    @property
    def coordinators(self) -> str:
        """``--coordinator`` for the ranks: every API process's handshake address."""
        return ",".join(f"127.0.0.1:{port}" for port in self.handshake_ports)

    def _spawn(self, index: int) -> subprocess.Popen[bytes]:
        assert self._listener is not None and self._pipe is not None
        options = replace(self.options, zmq_ports=(self.handshake_ports[index], 0, 0))
        spec = ApiProcessSpec(index, options, self._listener.fileno(), self._pipe[0])
        argv = [
            sys.executable,
            *(["-P"] if sys.version_info >= (3, 11) else []),
            *("-m", "corefleet.engine.entrypoints.api_servers"),
        ]
        proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, pass_fds=(self._listener.fileno(), self._pipe[0])
        )
        assert proc.stdin is not None
        proc.stdin.write(msgspec.json.encode(spec))
        proc.stdin.close()
        return proc

    def stop(self) -> None:
        """SIGTERM every API process (each finishes its streams), wait, SIGKILL stragglers."""
        try:
            if self.respawner is not None:
                self.respawner.terminate(self.options.shutdown_timeout_s + 5)
        finally:
            if self._listener is not None:
                self._listener.close()
            if self._pipe is not None:
                for end in self._pipe:
                    os.close(end)
                self._pipe = None


async def run_supervisor(api: LocalApiServers, ranks: LocalRanks) -> int:
    """``serve`` with N API processes: start them and the ranks, restart what dies, stop all
    on SIGTERM/SIGINT; returns the exit code."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    api.start()
    watchers: list[asyncio.Task[None]] = []
    try:
        ranks.start(api.coordinators)
        assert api.respawner is not None
        restarting = lambda: not stop.is_set()  # noqa: E731
        watchers = [
            asyncio.create_task(api.respawner.supervise(_log_exit, _serving, restarting)),
            # The coordinators see a rank die on its closed connections; here it only restarts.
            asyncio.create_task(ranks.supervise(_log_exit, _serving, restarting)),
        ]
        logger.info(
            "serving on http://%s:%d with %d API processes (pids %s)",
            api.options.host,
            api.options.port,
            api.count,
            ", ".join(str(p.pid) for p in api.procs),
        )
        await stop.wait()
        logger.info("shutting down: the API processes first, then the ranks")
    finally:
        for watcher in watchers:
            watcher.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
        await asyncio.to_thread(api.stop)
        await asyncio.to_thread(ranks.stop)
    return 0


def _log_exit(index: int, pid: int, how: str) -> None:
    logger.debug("child %d (pid %d) %s", index, pid, how)


def _serving(index: int, pid: int) -> bool:
    # The supervisor cannot see the coordinators' membership: a child alive for a while counts
    # as serving, which is what resets its restart back-off.
    return True


def main() -> int:
    """One API process: read its spec from standard input, serve until told to stop."""
    spec = msgspec.json.decode(sys.stdin.buffer.read(), type=ApiProcessSpec)
    logging.basicConfig(
        level=envs.log_level(),
        format=f"%(asctime)s %(levelname)s api-{spec.index} %(name)s: %(message)s",
        stream=sys.stderr,
    )
    return event_loop.run(run(spec.options, listen_fd=spec.listen_fd, parent_fd=spec.parent_fd))


if __name__ == "__main__":
    sys.exit(main())
