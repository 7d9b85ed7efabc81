"""`corefleet-operator`: run the operator (`kopf run -m corefleet.operator.main` underneath).

Defaults suit a Deployment in the cluster: a liveness endpoint on :8080/healthz, and kopf
peering named `corefleet-operator` for leader election between replicas: each replica takes a
random priority unless one is given, the highest-priority live replica works and the others pause
until it is gone. Peering needs kopf's KopfPeering/ClusterKopfPeering CRDs and an object of that
name (`crds/kopf-peering.yaml`); `--standalone` runs without it (a single replica).
"""

from __future__ import annotations

import argparse
import secrets
from collections.abc import Sequence

import kopf.cli

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
    parser.add_argument(
        "--standalone",
        action="store_true",
        help="no peering: for a single replica or a cluster without kopf's CRDs",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="verbose logging")
    return parser


def kopf_args(argv: Sequence[str] | None = None) -> list[str]:
    """The `kopf` command line for corefleet-operator's arguments."""
    args = build_parser().parse_args(argv)
    out = ["run", "-m", "corefleet.operator.main"]
    if args.namespace:
        for namespace in args.namespace:
            out += ["--namespace", namespace]
    else:
        out.append("--all-namespaces")
    if args.liveness:
        out += ["--liveness", args.liveness]
    if args.standalone:
        out.append("--standalone")
    else:
        priority = args.priority if args.priority is not None else 1 + secrets.randbelow(10_000)
        out += ["--peering", args.peering, "--priority", str(priority)]
    if args.verbose:
        out.append("--verbose")
    return out


def cli(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point."""
    kopf.cli.main(args=kopf_args(argv), prog_name="corefleet-operator")
