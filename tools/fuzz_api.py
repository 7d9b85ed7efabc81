"""Fuzz the HTTP API against its own OpenAPI document with schemathesis, for longer than CI.

``tests/integration/test_openapi.py`` runs a short deterministic pass on every change; this is
the long run, by hand. It points schemathesis at ``GET /openapi.json`` of a running server, or
of one it starts (``corefleet serve``) and stops, and checks every answer: no server error
(5xx), no undocumented status or content type, every body (and streamed event) as documented,
and no schema-valid request refused, except a 400 whose ``error.code`` the document lists as
beyond JSON Schema (``SCHEMA_VALID_REFUSALS``: a prompt too long in tokens, ...).

Usage (from the repository root)::

    # a server already running, with an API key
    .venv/bin/python tools/fuzz_api.py --url http://127.0.0.1:8000 --api-key KEY

    # serve a model for the run (flags after --serve-arg go to corefleet serve)
    .venv/bin/python tools/fuzz_api.py --model /path/to/model --examples 500 --seed 7 \\
        --serve-arg=--max-model-len --serve-arg=256

    # the embedded SmolLM2, only the completions endpoint, schemathesis flags passed through
    .venv/bin/python tools/fuzz_api.py --model default --include-path /v1/completions

Flags it does not know go to ``st run`` as they are (``--include-path``, ``--max-time``,
``--report junit``, ...; see ``st run --help``). With ``--workers`` above 1 the server may
answer 429 (documented, but it counts as refusing a valid request). The document cannot know
which conversations a model's chat template refuses (the tiny test model's refuses the role
``tool``); such a refusal is found as a failure. schemathesis keeps the failures it found in
``.schemathesis/`` of the current directory and tries them first on the next run. Exit
status: schemathesis' (0: nothing found); each failure comes with a curl command.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import schemathesis
from schemathesis.core.transport import Response
from schemathesis.openapi.checks import RejectedPositiveData
from schemathesis.specs.openapi import checks as st_checks

from corefleet.engine.openai.errors import SCHEMA_VALID_REFUSALS

CHECKS = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
    "accepts_schema_valid_data",
)


@schemathesis.check
def accepts_schema_valid_data(ctx: Any, response: Response, case: schemathesis.Case) -> Any:
    """schemathesis' ``positive_data_acceptance``, but for the refusals the document lists as
    beyond JSON Schema: a 400 whose ``error.code`` is one of ``SCHEMA_VALID_REFUSALS``."""
    try:
        return st_checks.positive_data_acceptance(ctx, response, case)
    except RejectedPositiveData:
        if response.status_code == 400 and _error_code(response) in SCHEMA_VALID_REFUSALS:
            return None
        raise


def _error_code(response: Response) -> Any:
    try:
        return response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _served(args: argparse.Namespace) -> Iterator[str]:
    """The base URL of the server to fuzz: ``--url``, or a ``corefleet serve`` of ``--model``
    started here and stopped (SIGTERM, then SIGKILL) on the way out."""
    if args.url:
        yield args.url.rstrip("/")
        return
    port = _free_port()
    argv = [sys.executable, "-m", "corefleet.engine.cli", "serve", "--port", str(port)]
    argv += [] if args.model == "default" else ["--model", args.model]
    argv += ["--api-key", args.api_key] if args.api_key else []
    proc = subprocess.Popen([*argv, *args.serve_arg])
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + args.start_timeout
        while not _ready(base):
            if proc.poll() is not None:
                raise SystemExit(f"corefleet serve exited with {proc.returncode}")
            if time.monotonic() > deadline:
                raise SystemExit(f"corefleet serve not ready in {args.start_timeout:g} s")
            time.sleep(0.5)
        yield base
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _ready(base: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"{base}/ready", timeout=2).status_code == 200
    return False


def _schemathesis_argv(base: str, args: argparse.Namespace, extra: list[str]) -> list[str]:
    argv = [f"{base}/openapi.json", "--checks", ",".join(CHECKS), "--mode", args.mode]
    argv += ["--max-examples", str(args.examples), "--seed", str(args.seed)]
    argv += ["--phases", args.phases, "--workers", "1", "--generation-database", "none"]
    argv += ["--request-timeout", str(args.request_timeout), "--output-sanitize", "false"]
    if args.api_key:
        argv += ["--header", f"Authorization: Bearer {args.api_key}"]
    return ["run", *argv, *extra]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Fuzz the API against its OpenAPI document (see the module docstring).",
        epilog="Unknown flags are passed to `st run`.",
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="base URL of a running server, e.g. http://127.0.0.1:8000")
    where.add_argument("--model", help="serve this model ('default': the embedded SmolLM2)")
    parser.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        help="a flag for corefleet serve (repeat it; write --serve-arg=--flag for dashes)",
    )
    parser.add_argument("--api-key", help="the API key (served with it when --model)")
    parser.add_argument("--examples", type=int, default=200, help="examples per operation")
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: random)")
    parser.add_argument("--mode", choices=("positive", "negative", "all"), default="all")
    parser.add_argument("--phases", default="examples,coverage,fuzzing")
    parser.add_argument("--request-timeout", type=float, default=300.0, help="seconds")
    parser.add_argument(
        "--start-timeout", type=float, default=600.0, help="seconds to wait for --model"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the fuzzer; returns schemathesis' exit status."""
    args, extra = _parser().parse_known_args(argv)
    if args.seed is None:
        args.seed = random.randrange(2**31)
    print(f"seed {args.seed} (pass --seed {args.seed} to repeat this run)", flush=True)
    from schemathesis.cli import schemathesis as cli  # after the check above is registered

    with _served(args) as base:
        try:
            cli.main(_schemathesis_argv(base, args, extra), prog_name="st")
        except SystemExit as done:
            return done.code if isinstance(done.code, int) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
