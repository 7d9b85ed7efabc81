"""``corefleet coordinator`` and ``corefleet serve``: the fleet's front door, as one process.

``coordinator`` binds the handshake, input and output sockets and the HTTP API and waits for
ranks to dial in (the rank pods' ``corefleet engine-core --coordinator NAME:5570``).
``serve`` is the same process plus N local ``engine-core`` children dialling it over loopback.

SIGTERM/SIGINT: ``/ready`` turns 503 at once; after ``--shutdown-delay`` (0 by default; the
operator gives a coordinator pod 5 s, for the Service to drop it while it still serves, every
response closing its connection) the HTTP server stops accepting and lets open streams finish
within ``--shutdown-timeout``; then local ranks get SIGTERM (they drain with the same timeout)
and the process exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from dataclasses import dataclass, field

from corefleet.engine import envs
from corefleet.engine.coordinator.fleet_client import FleetClient
from corefleet.engine.coordinator.routing import make_policy
from corefleet.engine.entrypoints.http_server import ApiServer, uvicorn_config
from corefleet.engine.entrypoints.local_ranks import LocalRanks
from corefleet.engine.frontend.tokenizer import Tokenizer
from corefleet.engine.models.default_model import served_model_name
from corefleet.engine.models.gguf_metadata import release_gguf_reader
from corefleet.engine.models.loader import resolve_model_path
from corefleet.engine.openai.admission import ApiKeys
from corefleet.engine.openai.api_options import ApiOptions
from corefleet.engine.openai.api_server import build_app
from corefleet.engine.openai.generation_api import GenerationApi
from corefleet.engine.openai.limits import RequestLimits
from corefleet.engine.openai.metrics import ServingMetrics
from corefleet.engine.openai.server_options import ServerOptions
from corefleet.engine.openai.server_state import ServerState
from corefleet.engine.openai.structured_options import StructuredOutputsConfig
from corefleet.engine.openai.tool_options import ToolOptions
from corefleet.engine.transport.sockets import load_curve_keys

logger = logging.getLogger(__name__)

MAX_SHUTDOWN_S = 86_400.0  # a day: longer is a typo, and would hold a pod for good
SHARED_SOCKET_WAIT_S = 30.0  # how long a process on a shared socket waits for a rank


@dataclass(frozen=True)
class CoordinatorOptions:
    """Everything ``corefleet coordinator`` takes (``serve`` adds local ranks)."""

    model: str | None = None
    served_model_name: str | None = None
    host: str = "0.0.0.0"  # HTTP
    port: int = 8000
    bind_host: str = "0.0.0.0"  # ZMQ sockets
    advertise_host: str | None = None  # None: POD_IP, else this host's address
    zmq_ports: tuple[int, int, int] = (5570, 5571, 5572)
    routing: str = "least-loaded"
    block_size: int = 16  # for prefix-aware routing: the ranks' KV block size
    api_keys: tuple[str, ...] = ()  # empty: the API is open
    limits: RequestLimits = field(default_factory=RequestLimits)
    tools: ToolOptions = field(default_factory=ToolOptions)
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    api: ApiOptions = field(default_factory=ApiOptions)
    server: ServerOptions = field(default_factory=ServerOptions)
    max_migrations: int = 2
    heartbeat_timeout_s: float = 10.0
    shutdown_timeout_s: float = 30.0
    shutdown_delay_s: float = 0.0  # not ready, still serving, this long before stopping
    curve_keys_dir: str | None = None

    def __post_init__(self) -> None:
        for name, value in (
            ("--shutdown-timeout", self.shutdown_timeout_s),
            ("--shutdown-delay", self.shutdown_delay_s),
        ):
            if not 0 <= value <= MAX_SHUTDOWN_S:
                raise ValueError(f"{name} {value} must be between 0 and {MAX_SHUTDOWN_S} seconds")


def advertised_host(options: CoordinatorOptions) -> str:
    if options.advertise_host:
        return options.advertise_host
    if options.bind_host not in ("0.0.0.0", "::", ""):
        return options.bind_host
    return envs.pod_ip() or socket.gethostbyname(socket.gethostname())


async def run(
    options: CoordinatorOptions,
    local_ranks: LocalRanks | None = None,
    *,
    listen_fd: int | None = None,
    parent_fd: int | None = None,
) -> int:
    """Serve until a signal; returns the exit code.

    ``listen_fd``: serve HTTP on this inherited listening socket instead of binding
    ``options.host:port`` (the API processes of ``serve --api-server-count``, which share it).
    ``parent_fd``: the read end of a pipe the parent holds open; its end of file (the parent
    died) stops this process at once.
    """
    model_path = resolve_model_path(options.model)
    tokenizer = Tokenizer.from_model_path(model_path)
    release_gguf_reader()  # the coordinator needs nothing more from a GGUF file
    model_name = served_model_name(options.served_model_name, options.model, model_path)
    fleet = FleetClient(
        policy=make_policy(options.routing, options.block_size),
        max_migrations=options.max_migrations,
        bind_host=options.bind_host,
        advertise_host=advertised_host(options),
        ports=options.zmq_ports,
        curve=load_curve_keys("server", options.curve_keys_dir),
        heartbeat_timeout_s=options.heartbeat_timeout_s,
    )
    await fleet.start()
    state = ServerState(
        fleet,
        tokenizer,
        model_name,
        ApiKeys(options.api_keys),
        ServingMetrics(fleet, model_name),
        options.limits,
        options.tools,
        options.api,
        server=options.server,
        model_root=options.model or model_path,
        structured_outputs=options.structured_outputs,
    )
    api = GenerationApi(state)
    config = uvicorn_config(
        build_app(state, api),
        options.host,
        options.port,
        options.limits,
        options.shutdown_timeout_s,
        routes=api,
        root_path=options.server.root_path,
    )
    supervisor: asyncio.Task[None] | None = None
    try:
        if local_ranks is not None:
            local_ranks.start(fleet.server.ports[0])
            supervisor = asyncio.create_task(_supervise(local_ranks, fleet, state))
        logger.info("serving %s on http://%s:%d", model_name, options.host, options.port)
        server = ApiServer(config, state, options.shutdown_delay_s)
        if parent_fd is not None:
            _exit_with_parent(parent_fd, server)
        sockets = None
        if listen_fd is not None:
            sockets = [socket.socket(fileno=listen_fd)]
            await _until_a_rank_joins(fleet, SHARED_SOCKET_WAIT_S)
        await server.serve(sockets=sockets)
    finally:
        if supervisor is not None:
            supervisor.cancel()  # no restarts while the ranks are being stopped
            await asyncio.gather(supervisor, return_exceptions=True)
        if local_ranks is not None:
            await asyncio.to_thread(local_ranks.stop)
        await fleet.close()
    return 0


async def _until_a_rank_joins(fleet: FleetClient, timeout_s: float) -> None:
    """Wait (up to ``timeout_s``) for a rank to be ready before accepting on a shared socket.

    The other processes on the socket may serve already: a connection this process accepted
    before any rank joined it would get a 503 its neighbours would not have given (a restarted
    API process is joined by the ranks within a second or two).
    """
    deadline = time.monotonic() + timeout_s
    while not fleet.membership.accepting() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


def _exit_with_parent(parent_fd: int, server: ApiServer) -> None:
    """Stop at once when ``parent_fd`` reaches end of file: the parent that started this
    process died, and the ranks (its children too) are going with it."""
    loop = asyncio.get_running_loop()

    def on_readable() -> None:
        if os.read(parent_fd, 1):
            return  # nobody writes to it; a byte would be a bug, not a death
        loop.remove_reader(parent_fd)
        logger.warning("the parent process died; exiting")
        server.state.shutting_down = True
        server.should_exit = server.force_exit = True

    loop.add_reader(parent_fd, on_readable)


async def _supervise(ranks: LocalRanks, fleet: FleetClient, state: ServerState) -> None:
    """Local ranks that exit are dead for the fleet at once; they restart unless we stop."""

    def on_exit(rank: int, pid: int, how: str) -> None:
        fleet.server.process_exited(rank, pid, how)

    def is_ready(rank: int, pid: int) -> bool:
        member = fleet.membership.members.get(rank)
        return member is not None and member.pid == pid and member.accepting

    await ranks.supervise(on_exit, is_ready, restarting=lambda: not state.shutting_down)
