"""The ``corefleet`` command: ``generate`` and ``chat`` (offline), ``engine-core`` (one rank)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from corefleet.engine import envs
from corefleet.engine.engine_args import add_engine_args, engine_kwargs_from_args
from corefleet.engine.protocol import SamplingParams


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--sampling-seed", type=int, default=None, help="seed for sampling")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def build_parser() -> argparse.ArgumentParser:
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
    return parser


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
        help="HOST:PORT of the coordinator's handshake socket (or a tcp:// or ipc:// address)",
    )
    core.add_argument("--rank", type=int, default=0, help="this data-parallel rank (0-65535)")
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
    add_engine_args(core)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=envs.log_level(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "chat":
            return _chat(args)
        if args.command == "engine-core":
            return _engine_core(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"corefleet: error: {exc}", file=sys.stderr)
        return 2
    return 1


def _params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
        stop=list(args.stop),
    )


def _generate(args: argparse.Namespace) -> int:
    from corefleet.engine.frontend.llm import LLM

    llm = LLM(**engine_kwargs_from_args(args))
    params = _params(args)
    if args.chat:
        outputs = llm.chat(
            [[{"role": "user", "content": p}] for p in args.prompt], params, use_tqdm=False
        )
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    for out in outputs:
        completion = out.outputs[0]
        print(completion.text)
        print(
            f"[{len(completion.token_ids)} tokens, finish_reason={completion.finish_reason}]",
            file=sys.stderr,
        )
    llm.shutdown()
    return 0


def _engine_core(args: argparse.Namespace) -> int:
    from corefleet.engine.core_entry import run_engine_core
    from corefleet.engine.core_proc import EngineProcConfig
    from corefleet.engine.engine_args import engine_config_from_args
    from corefleet.engine.net import handshake_address, load_curve_keys

    proc_config = EngineProcConfig(
        handshake_address=handshake_address(args.coordinator),
        rank=args.rank,
        shutdown_mode=args.shutdown_mode,
        shutdown_timeout_s=args.shutdown_timeout,
        curve=load_curve_keys("client", args.curve_keys_dir),
        pod_name=envs.pod_name(),
        parent_pid=args.parent_pid,
        health_host=args.health_host,
        health_port=args.health_port,
    )
    return run_engine_core(engine_config_from_args(args), proc_config)


def _chat(args: argparse.Namespace) -> int:
    from corefleet.engine.frontend.llm import LLM

    llm = LLM(**engine_kwargs_from_args(args))
    params = _params(args)
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or not line.strip():
            break
        history.append({"role": "user", "content": line.strip()})
        reply = llm.chat(history, params, use_tqdm=False)[0].outputs[0].text
        history.append({"role": "assistant", "content": reply})
        print(reply, flush=True)
    llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
