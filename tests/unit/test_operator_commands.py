"""The command lines the operator writes into pods are ones the real CLI accepts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from corefleet.engine.cli import build_parser
from corefleet.engine.config import MAX_TENSOR_PARALLEL
from corefleet.engine.openai.tool_options import tool_options_from_args
from corefleet.engine.openai.tool_parsers import PARSER_NAMES
from corefleet.operator.flags import coordinator_args
from corefleet.operator.naming import Owner
from corefleet.operator.resources import build_engine_pod
from corefleet.operator.spec import MAX_TENSOR_PARALLEL as OPERATOR_MAX_TENSOR_PARALLEL
from corefleet.operator.spec import ROUTING_FLAGS, TOOL_CALL_PARSERS

sys.path.insert(0, str(Path(__file__).parent / "operator"))
from operator_fixtures import spec

EXTRAS = [
    {},
    {"shutdown": {"mode": "Abort"}},
    *({"coordinator": {"routing": r, "replicas": 2}} for r in sorted(ROUTING_FLAGS)),
    *({"coordinator": {"toolCallParser": name}} for name in TOOL_CALL_PARSERS),
    {"tensorParallelSize": 2},
    {"tensorParallelSize": 2, "pipelineParallelSize": 2},
    {"enableExpertParallel": True},
]


@pytest.mark.parametrize("extra", EXTRAS)
def test_rank_and_coordinator_commands_parse(extra: dict[str, object]) -> None:
    the_spec = spec(2, **extra)
    pod = build_engine_pod(Owner("x", "default", "uid"), the_spec, 1)
    rank = build_parser().parse_args(pod["spec"]["containers"][0]["args"])
    assert rank.rank == 1 and rank.model == the_spec.model.path
    assert rank.tensor_parallel_size == the_spec.tensor_parallel_size
    assert rank.pipeline_parallel_size == the_spec.pipeline_parallel_size
    if the_spec.enable_expert_parallel:  # one group: its size and rank 0's rendezvous
        assert rank.enable_expert_parallel is True and rank.data_parallel_size == 2
        assert rank.data_parallel_address == "x-engine-0.x-engine:29550"
    coordinator = build_parser().parse_args(coordinator_args("x", the_spec))
    assert coordinator.block_size == the_spec.engine.block_size
    assert coordinator.shutdown_timeout == the_spec.shutdown.effective_timeout_seconds


def test_the_tool_call_parser_reaches_the_coordinator_and_enables_auto() -> None:
    assert TOOL_CALL_PARSERS == PARSER_NAMES  # the operator cannot import the engine's list
    for name in TOOL_CALL_PARSERS:
        the_spec = spec(1, coordinator={"toolCallParser": name})
        options = tool_options_from_args(build_parser().parse_args(coordinator_args("x", the_spec)))
        assert options.auto_parser == name
    plain = build_parser().parse_args(coordinator_args("x", spec(1)))
    assert tool_options_from_args(plain).auto_parser is None


def test_the_operator_and_the_engine_bound_tensor_parallelism_alike() -> None:
    assert OPERATOR_MAX_TENSOR_PARALLEL == MAX_TENSOR_PARALLEL
