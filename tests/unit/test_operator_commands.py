"""The command lines the operator writes into pods are ones the real CLI accepts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from corefleet.engine.cli import build_parser
from corefleet.operator.flags import coordinator_args, engine_args

sys.path.insert(0, str(Path(__file__).parent / "operator"))
from operator_fixtures import spec


@pytest.mark.parametrize("extra", [{}, {"shutdown": {"mode": "Abort"}}])
def test_rank_and_coordinator_commands_parse(extra: dict[str, object]) -> None:
    the_spec = spec(2, **extra)
    rank = build_parser().parse_args(
        [
            "engine-core",
            "--coordinator",
            "x-coordinator:5570",
            "--rank",
            "1",
            *engine_args(the_spec),
        ]
    )
    assert rank.rank == 1 and rank.model == the_spec.model.path
    coordinator = build_parser().parse_args(coordinator_args("x", the_spec))
    assert coordinator.block_size == the_spec.engine.block_size
    assert coordinator.shutdown_timeout == the_spec.shutdown.effective_timeout_seconds
