"""The ``corefleet`` command: ``serve`` and ``coordinator`` (the OpenAI API), ``engine-core`` (one
rank), ``generate`` and ``chat`` (offline)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from corefleet.engine import envs
from corefleet.engine.config import CacheConfig
from corefleet.engine.coordinator.routing import POLICY_NAMES
from corefleet.engine.engine_args import add_engine_args
from corefleet.engine.entrypoints.offline_commands import chat_command, generate_command
from corefleet.engine.entrypoints.rank_cpus import add_rank_cpu_args
from corefleet.engine.openai.api_options import add_api_args
from corefleet.engine.openai.limits import add_limit_args
from corefleet.engine.openai.server_options import add_server_args
from corefleet.engine.openai.structured_options import add_structured_output_args
from corefleet.engine.openai.tool_options import add_tool_args
from corefleet.engine.worker.dp_settings import DEFAULT_DP_ADDRESS

logger = logging.getLogger(__name__)


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--sampling-seed", type=int, default=None, help="seed for sampling")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    """The ``corefleet`` parser; use :func:`parse_args`, which also resolves ``serve MODEL``."""
    parser = argparse.ArgumentParser(
        prog="corefleet",
        description="corefleet: LLM inference engine and Kubernetes fleet. "
        "Without --model, runs the embedded SmolLM2-135M-Instruct.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = sub.add_parser(
        "generate",
        help="complete one prompt (or a chat turn) and print it",
        description="Generate text for a prompt with an in-process engine.",
    )
    gen.add_argument(
        "--prompt", action="append", required=True, help="prompt text (repeat for a batch)"
    )
    gen.add_argument(
        "--chat",
        action="store_true",
        help="wrap each prompt as a user message in the model's chat template",
    )
    _sampling_args(gen)
    add_engine_args(gen)

    chat = sub.add_parser(
        "chat",
        help="interactive chat on stdin/stdout",
        description="Chat with the model; one user message per line of "
        "stdin, an empty line or EOF ends the session.",
    )
    chat.add_argument("--system", default=None, help="system message")
    _sampling_args(chat)
    add_engine_args(chat)
    _engine_core_parser(sub)
    _serve_parsers(sub)
    return parser


def _http_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("HTTP API and routing")
    g.add_argument(
        "--host", default=None, help="HTTP address (serve: 127.0.0.1, coordinator: 0.0.0.0)"
    )
    g.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    g.add_argument(
        "--routing",
        choices=POLICY_NAMES,
        default="least-loaded",
        help="how requests are spread over the ranks",
    )
    g.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1 and /admin; repeat for several keys "
        "(or COREFLEET_API_KEY, comma-separated)",
    )
    g.add_argument(
        "--max-migrations",
        type=int,
        default=2,
        help="times a request may move to another rank when its rank dies (then: an error)",
    )
    add_limit_args(parser)
    add_tool_args(parser)
    add_structured_output_args(parser)
    add_api_args(parser)
    add_server_args(parser)


def _serve_parsers(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser(
        "serve",
        help="the OpenAI-compatible API over N local engine ranks (one machine)",
        description="Start the coordinator (OpenAI-compatible HTTP API) and N engine-core "
        "processes on this machine. Without MODEL (or --model), serves the embedded SmolLM2.",
    )
    # vLLM's `vllm serve MODEL`; parse_args() moves it into --model's place.
    serve.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="Hugging Face folder or .gguf file to serve (the same as --model)",
    )
    serve.add_argument(
        "--data-parallel-size", type=int, default=1, help="local engine ranks (default 1)"
    )
    serve.add_argument(
        "--api-server-count",
        type=int,
        default=1,
        help="API processes sharing the HTTP port (vLLM's flag; 1-64, default 1). Above 1, "
        "each is a whole coordinator that every rank joins; one that dies is restarted and "
        "takes only its own streams with it",
    )
    serve.add_argument("--shutdown-mode", choices=["drain", "abort"], default="drain")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0)
    add_rank_cpu_args(serve)
    _http_args(serve)
    add_engine_args(serve)

    coord = sub.add_parser(
        "coordinator",
        help="the OpenAI-compatible API; ranks dial in (a coordinator pod)",
        description="Serve the HTTP API and wait for engine-core ranks to connect to the "
        "handshake port. Engines find it by a Service name; INIT advertises this pod's address.",
    )
    coord.add_argument("--model", default=None, help="model path (for its tokenizer)")
    coord.add_argument("--served-model-name", default=None)
    coord.add_argument(
        "--block-size",
        type=int,
        default=CacheConfig().block_size,
        help="the ranks' KV block size",
    )
    coord.add_argument(
        "--advertise-host", default=None, help="address ranks reach us at (default: POD_IP)"
    )
    coord.add_argument("--handshake-port", type=int, default=5570)
    coord.add_argument("--input-port", type=int, default=5571)
    coord.add_argument("--output-port", type=int, default=5572)
    coord.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds open requests may take to finish once the server stops (default 30)",
    )
    coord.add_argument(
        "--shutdown-delay",
        type=float,
        default=0.0,
        help="on SIGTERM, seconds to go on serving while /ready says 503 (so a Service drops "
        "this pod first; every response then closes its connection) before stopping (default 0)",
    )
    coord.add_argument("--curve-keys-dir", default=None)
    _http_args(coord)


def _engine_core_parser(sub: argparse._SubParsersAction) -> None:
    core = sub.add_parser(
        "engine-core",
        help="run one data-parallel rank: connect to a coordinator and serve it",
        description="Run an engine core process (one data-parallel rank). It connects to the "
        "coordinator's handshake port, loads the model, allocates the KV cache and serves "
        "requests until SIGTERM/SIGINT, then drains or aborts (--shutdown-mode) and exits 0. "
        "CURVE keys come from --curve-keys-dir or COREFLEET_CURVE_{SERVER,PUBLIC,SECRET}_KEY.",
    )
    core.add_argument(
        "--coordinator",
        required=True,
        help="HOST:PORT of the coordinators' handshake socket (or a tcp:// or ipc:// address); "
        "several comma-separated. The rank joins every coordinator: a name resolves to all its "
        "addresses (a headless Service: one per coordinator pod), again every 2 s",
    )
    core.add_argument("--rank", type=int, default=0, help="this data-parallel rank (0-65535)")
    core.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="ranks in the fleet's data-parallel group (default 1). With a mixture-of-experts "
        "model and a size above 1, ranks 0 .. N-1 form one torch.distributed group and step "
        "together in waves, as vLLM's; other models ignore it (their ranks are independent). "
        "Needs --tensor-parallel-size and --pipeline-parallel-size 1",
    )
    core.add_argument(
        "--data-parallel-address",
        default=DEFAULT_DP_ADDRESS,
        metavar="HOST:PORT",
        help="where rank 0 hosts the group's rendezvous and the others reach it (a cluster: "
        f"rank 0's pod; default {DEFAULT_DP_ADDRESS}, for one machine)",
    )
    core.add_argument(
        "--shutdown-mode",
        choices=["drain", "abort"],
        default="drain",
        help="on SIGTERM: drain (finish in-flight requests, refuse new ones) or abort them all",
    )
    core.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds a drain may take before the rest is aborted (default 30)",
    )
    core.add_argument(
        "--curve-keys-dir",
        default=None,
        help="folder with client-public, client-secret and server-public (a mounted Secret)",
    )
    core.add_argument(
        "--health-port",
        type=int,
        default=8001,
        help="port of GET /health (liveness) and GET /ready (readiness); 0 turns them off",
    )
    core.add_argument(
        "--health-host", default="0.0.0.0", help="address the health endpoints bind to"
    )
    core.add_argument(
        "--parent-pid",
        type=int,
        default=None,
        help="abort and exit when this process stops being the parent (local clients use it)",
    )
    core.add_argument(
        "--parent-fd",
        type=int,
        default=None,
        help="read end of a pipe the parent holds open: abort and exit at its end of file, "
        "i.e. at once when the parent dies (local clients pass it)",
    )
    core.add_argument(
        "--cpu-set",
        default=None,
        metavar="CPUS",
        help="run on these cores only (e.g. 0-1,4; within this process's affinity); the CPU "
        "threads are then sized from them (serve passes each rank its own)",
    )
    add_engine_args(core)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse a ``corefleet`` command line; ``serve MODEL`` sets ``args.model``.

    Giving both ``MODEL`` and ``--model`` is allowed only when they agree.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    tag = getattr(args, "model_tag", None)
    if tag is not None:
        if args.model is not None and args.model != tag:
            parser.error(
                f"{args.command}: the positional MODEL {tag!r} and --model {args.model!r} "
                "differ; give the model once"
            )
        args.model = tag
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run a ``corefleet`` command; returns the exit code (2 for a bad argument)."""
    args = parse_args(argv)
    logging.basicConfig(
        level=envs.log_level(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        if args.command == "generate":
            return generate_command(args)
        if args.command == "chat":
            return chat_command(args)
        if args.command == "engine-core":
            return _engine_core(args)
        if args.command in ("serve", "coordinator"):
            return _serve(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"corefleet: error: {exc}", file=sys.stderr)
        return 2
    return 1


def _engine_core(args: argparse.Namespace) -> int:
    from corefleet.engine.worker.cpu_allowance import apply_cpu_set, parse_cpu_list, read_allowance

    # First thing, before torch is imported: its thread pool sizes itself and its threads
    # inherit the affinity when they start, so a later pin would leave them on other cores.
    if args.cpu_set is not None:
        apply_cpu_set(parse_cpu_list(args.cpu_set))
    wait_policy = envs.openmp_wait_passive()  # also before torch: libgomp reads it at load
    # Checked here too (the executor applies it) so a misfit fails before the model loads.
    allowance = read_allowance(envs.cpu_threads(), envs.cpu_request_millicores())
    logger.info("rank %d: %s; OpenMP wait policy %s", args.rank, allowance.describe(), wait_policy)

    from corefleet.engine.engine_args import engine_config_from_args
    from corefleet.engine.engine_core.entry import run_engine_core
    from corefleet.engine.engine_core.proc_config import EngineProcConfig
    from corefleet.engine.transport.discovery import parse_coordinators
    from corefleet.engine.transport.sockets import load_curve_keys
    from corefleet.engine.worker.dp_settings import DPGroupSettings

    data_parallel = DPGroupSettings(
        size=args.data_parallel_size,
        address=args.data_parallel_address,
        collective_timeout_s=envs.dp_collective_timeout_s(),
        formation_timeout_s=envs.dp_formation_timeout_s(),
        peer_timeout_s=envs.dp_peer_timeout_s(),
    )
    proc_config = EngineProcConfig(
        handshake_address=",".join(parse_coordinators(args.coordinator)),
        rank=args.rank,
        shutdown_mode=args.shutdown_mode,
        shutdown_timeout_s=args.shutdown_timeout,
        curve=load_curve_keys("client", args.curve_keys_dir),
        pod_name=envs.pod_name(),
        parent_pid=args.parent_pid,
        parent_fd=args.parent_fd,
        health_host=args.health_host,
        health_port=args.health_port,
        data_parallel=data_parallel,
    )
    return run_engine_core(engine_config_from_args(args), proc_config)


def _serve(args: argparse.Namespace) -> int:
    from corefleet.engine.entrypoints.serve_command import serve_command

    return serve_command(args)


if __name__ == "__main__":
    sys.exit(main())
