"""`corefleet-operator`: run the operator (`kopf run -m corefleet.operator.main` underneath).

Defaults suit a Deployment in the cluster: a liveness endpoint on :8080/healthz, and kopf
peering named `corefleet-operator` for leader election between replicas: each replica takes a
random priority unless one is given, the highest-priority live replica works and the others pause
until it is gone. Peering needs kopf's KopfPeering/ClusterKopfPeering CRDs
(`crds/kopf-peering.yaml`) and an object of that name for the served scope (`deploy/peering/`).
Before kopf starts, the command checks that they exist (`peering.py`): if not, it runs standalone
with a warning, or with `--require-peering` (several replicas) exits with an error naming the
object and the command that creates it. `--standalone` skips peering and the check.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
from collections.abc import Sequence

import kopf
import kopf.cli

from corefleet.operator import peering
from corefleet.operator.settings import OperatorConfig

PEERING = "corefleet-operator"
LIVENESS = "http://0.0.0.0:8080/healthz"


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    parser = argparse.ArgumentParser(
        prog="corefleet-operator", description="Reconcile InferenceEngine resources."
    )
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        help="namespace to serve (repeatable; globs allowed)",
    )
    scope.add_argument(
        "-A",
        "--all-namespaces",
        action="store_true",
        help="serve every namespace (the default when no --namespace is given)",
    )
    parser.add_argument(
        "--liveness",
        default=LIVENESS,
        help=f"liveness endpoint URL (default {LIVENESS}; '' turns it off)",
    )
    parser.add_argument("--peering", default=PEERING, help="kopf peering object name")
    parser.add_argument(
        "--priority",
        type=int,
        default=None,
        help="peering priority (default: random, so one replica leads)",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--standalone",
        action="store_true",
        help="no peering and no check for it: for a single replica",
    )
    mode.add_argument(
        "--require-peering",
        action="store_true",
        help="exit with an error if a peering object is missing (a KopfPeering in each served"
        " namespace, the ClusterKopfPeering with --all-namespaces) instead of running standalone"
        " with a warning: for several replicas",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="verbose logging")
    return parser


def kopf_args(argv: Sequence[str] | None = None, peered: bool = True) -> list[str]:
    """The `kopf` command line for corefleet-operator's arguments (`peered=False`: standalone)."""
    args = build_parser().parse_args(argv)
    out = ["run", "-m", "corefleet.operator.main"]
    if args.namespace:
        for namespace in args.namespace:
            out += ["--namespace", namespace]
    else:
        out.append("--all-namespaces")
    if args.liveness:
        out += ["--liveness", args.liveness]
    if args.standalone or not peered:
        out.append("--standalone")
    else:
        priority = args.priority if args.priority is not None else 1 + secrets.randbelow(10_000)
        out += ["--peering", args.peering, "--priority", str(priority)]
    if args.verbose:
        out.append("--verbose")
    return out


def cli(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point: the peering pre-flight, then kopf."""
    args = build_parser().parse_args(argv)
    kopf.configure(verbose=args.verbose)  # kopf's log format for the pre-flight's lines too
    peered = False
    if not args.standalone:
        check = peering.Preflight(
            namespaces=tuple(args.namespace),
            name=args.peering,
            timeout=OperatorConfig.from_env().request_timeout_seconds,
        )
        peered = peering.decide(asyncio.run(check.problems()), required=args.require_peering)
    kopf.cli.main(args=kopf_args(argv, peered=peered), prog_name="corefleet-operator")
