"""``corefleet serve`` and ``corefleet coordinator`` from their parsed command line."""

from __future__ import annotations

import argparse

from corefleet.engine import envs
from corefleet.engine.engine_args import engine_config_from_args
from corefleet.engine.entrypoints import event_loop
from corefleet.engine.entrypoints.coordinator import CoordinatorOptions, run
from corefleet.engine.entrypoints.local_ranks import LocalRanks, rank_memory_share
from corefleet.engine.entrypoints.rank_cpus import plan_from_args
from corefleet.engine.openai.api_options import api_options_from_args
from corefleet.engine.openai.limits import limits_from_args
from corefleet.engine.openai.server_options import server_options_from_args
from corefleet.engine.openai.structured_options import structured_outputs_config_from_args
from corefleet.engine.openai.tool_options import tool_options_from_args

MAX_API_SERVERS = 64  # each is a process of a few hundred MB; more is a typo, not a plan


def serve_command(args: argparse.Namespace) -> int:
    """Run ``serve`` or ``coordinator`` until a signal; returns the exit code. ValueError: a
    bad combination of flags."""
    api_keys = tuple(args.api_key or ()) or envs.api_keys()
    limits = limits_from_args(args)
    tools = tool_options_from_args(args)
    structured_outputs = structured_outputs_config_from_args(args)
    api = api_options_from_args(args)
    server = server_options_from_args(args)
    if args.command == "coordinator":
        options = CoordinatorOptions(
            model=args.model,
            served_model_name=args.served_model_name,
            host=args.host or "0.0.0.0",
            port=args.port,
            advertise_host=args.advertise_host,
            zmq_ports=(args.handshake_port, args.input_port, args.output_port),
            routing=args.routing,
            block_size=args.block_size,
            api_keys=api_keys,
            limits=limits,
            tools=tools,
            structured_outputs=structured_outputs,
            api=api,
            server=server,
            max_migrations=args.max_migrations,
            shutdown_timeout_s=args.shutdown_timeout,
            shutdown_delay_s=args.shutdown_delay,
            curve_keys_dir=args.curve_keys_dir,
        )
        return event_loop.run(run(options))
    config = engine_config_from_args(args)
    if args.data_parallel_size < 1:
        raise ValueError("--data-parallel-size must be at least 1")
    if not 1 <= args.api_server_count <= MAX_API_SERVERS:
        raise ValueError(
            f"--api-server-count {args.api_server_count} must be between 1 and {MAX_API_SERVERS}"
        )
    options = CoordinatorOptions(
        model=args.model,
        served_model_name=args.served_model_name,
        host=args.host or "127.0.0.1",
        port=args.port,
        bind_host="127.0.0.1",
        zmq_ports=(0, 0, 0),
        routing=args.routing,
        block_size=config.cache.block_size,
        api_keys=api_keys,
        limits=limits,
        tools=tools,
        structured_outputs=structured_outputs,
        api=api,
        server=server,
        max_migrations=args.max_migrations,
        shutdown_timeout_s=args.shutdown_timeout,
    )
    ranks = LocalRanks(
        config,
        args.data_parallel_size,
        args.shutdown_mode,
        args.shutdown_timeout,
        rank_cpus=plan_from_args(args),
        memory_share=rank_memory_share(config, args.data_parallel_size),
    )
    if args.api_server_count == 1:
        return event_loop.run(run(options, ranks))  # one process serves and supervises the ranks
    from corefleet.engine.entrypoints.api_servers import LocalApiServers, run_supervisor

    return event_loop.run(run_supervisor(LocalApiServers(options, args.api_server_count), ranks))
