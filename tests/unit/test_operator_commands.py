"""The command lines the operator writes into pods are ones the real CLI accepts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from corefleet.engine.cli import build_parser
from corefleet.operator.flags import coordinator_args
from corefleet.operator.naming import Owner
from corefleet.operator.resources import build_engine_pod
from corefleet.operator.spec import ROUTING_FLAGS

sys.path.insert(0, str(Path(__file__).parent / "operator"))
from operator_fixtures import spec

EXTRAS = [
    {},
    {"shutdown": {"mode": "Abort"}},
    *({"coordinator": {"routing": r, "replicas": 2}} for r in sorted(ROUTING_FLAGS)),
]


@pytest.mark.parametrize("extra", EXTRAS)
def test_rank_and_coordinator_commands_parse(extra: dict[str, object]) -> None:
    the_spec = spec(2, **extra)
    pod = build_engine_pod(Owner("x", "default", "uid"), the_spec, 1)
    rank = build_parser().parse_args(pod["spec"]["containers"][0]["args"])
    assert rank.rank == 1 and rank.model == the_spec.model.path
    coordinator = build_parser().parse_args(coordinator_args("x", the_spec))
    assert coordinator.block_size == the_spec.engine.block_size
    assert coordinator.shutdown_timeout == the_spec.shutdown.effective_timeout_seconds
