"""Engine flags <-> EngineConfig: the argv a client hands to ``corefleet engine-core`` must
rebuild exactly the config it was made from, for every field of every section."""

from __future__ import annotations

import dataclasses

import pytest

from corefleet.engine.cli import build_parser
from corefleet.engine.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from corefleet.engine.engine_args import engine_argv_from_config, engine_config_from_args

NULL_EXECUTOR = "corefleet.engine.worker.null_executor:NullExecutor"

SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "device": DeviceConfig,
    "parallel": ParallelConfig,
}

# One non-default value per config field (keyed by the field's name, as from_kwargs takes it).
NON_DEFAULT: dict[str, object] = {
    "model": "/models/My Llama/llama-3.2-1b.Q8_0.gguf",
    "served_model_name": "team/llama-small",
    "max_model_len": 4096,
    "dtype": "bfloat16",
    "seed": 1234,
    "max_num_seqs": 7,
    "max_num_batched_tokens": 513,
    "enable_chunked_prefill": False,
    "policy": "priority",
    "block_size": 32,
    "enable_prefix_caching": False,
    "kv_cache_memory": 123_456_789,
    "num_blocks_override": 64,
    "gpu_memory_utilization": 0.55,
    "device": "cpu",
    "attention_backend": "torch",
    "distributed_executor_backend": NULL_EXECUTOR,
}

# Fields with a single valid value: they cannot be varied, only carried with their default.
SINGLE_VALUED = {"tensor_parallel_size": "--tensor-parallel-size"}

# Extra values worth a round trip of their own.
EXTRA_CASES: dict[str, dict[str, object]] = {
    "gpu_memory_utilization=1/3": {"gpu_memory_utilization": 1 / 3},
    "gpu_memory_utilization=1.0": {"gpu_memory_utilization": 1.0},
    "dtype=float16": {"dtype": "float16"},
    "dtype=float32": {"dtype": "float32"},
    "num_blocks_override=2": {"num_blocks_override": 2},
    "everything-at-once": dict(NON_DEFAULT),
}

ROUND_TRIP_CASES: dict[str, dict[str, object]] = {
    "defaults": {},
    **{name: {name: value} for name, value in NON_DEFAULT.items()},
    **EXTRA_CASES,
}


def _field_names() -> dict[str, str]:
    """Every config field name -> its section name."""
    return {f.name: section for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)}


def _default_of(name: str) -> object:
    return getattr(SECTIONS[_field_names()[name]](), name)


def _parse_engine_core(argv: list[str]) -> EngineConfig:
    args = build_parser().parse_args(["engine-core", "--coordinator", "x:1", *argv])
    return engine_config_from_args(args)


def test_sections_match_engine_config() -> None:
    """The section table here is EngineConfig's own: a new section must be added here too."""
    assert {f.name for f in dataclasses.fields(EngineConfig)} == set(SECTIONS)
    config = EngineConfig()
    for name, cls in SECTIONS.items():
        assert type(getattr(config, name)) is cls


def test_every_config_field_has_a_round_trip_case() -> None:
    """A new config field without a case here (and so possibly without a flag) fails."""
    fields = set(_field_names())
    covered = set(NON_DEFAULT) | set(SINGLE_VALUED)
    assert fields - covered == set(), "config fields without a round-trip case"
    assert covered - fields == set(), "round-trip cases for fields that do not exist"


@pytest.mark.parametrize("name", sorted(NON_DEFAULT))
def test_non_default_value_really_differs_from_default(name: str) -> None:
    assert NON_DEFAULT[name] != _default_of(name)


@pytest.mark.parametrize("kwargs", list(ROUND_TRIP_CASES.values()), ids=list(ROUND_TRIP_CASES))
def test_argv_round_trip(kwargs: dict[str, object]) -> None:
    config = EngineConfig.from_kwargs(**kwargs)
    argv = engine_argv_from_config(config)
    assert all(isinstance(a, str) for a in argv)
    rebuilt = _parse_engine_core(argv)
    assert rebuilt == config
    for name, value in kwargs.items():
        assert getattr(getattr(rebuilt, _field_names()[name]), name) == value


@pytest.mark.parametrize("name", sorted(NON_DEFAULT))
def test_argv_differs_when_one_field_differs(name: str) -> None:
    """Each field reaches the argv: a changed field changes the command line."""
    default_argv = engine_argv_from_config(EngineConfig())
    changed_argv = engine_argv_from_config(EngineConfig.from_kwargs(**{name: NON_DEFAULT[name]}))
    assert changed_argv != default_argv


@pytest.mark.parametrize("name,flag", sorted(SINGLE_VALUED.items()))
def test_single_valued_fields_are_passed_on(name: str, flag: str) -> None:
    argv = engine_argv_from_config(EngineConfig())
    assert flag in argv
    assert argv[argv.index(flag) + 1] == str(_default_of(name))


def test_round_trip_through_a_plain_parser_with_engine_args() -> None:
    """The flags alone (no subcommand) as any command that calls add_engine_args takes them."""
    import argparse

    from corefleet.engine.engine_args import add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = EngineConfig.from_kwargs(**NON_DEFAULT)
    assert engine_config_from_args(parser.parse_args(engine_argv_from_config(config))) == config
    assert engine_config_from_args(parser.parse_args([])) == EngineConfig()


# --- compute_hash ----------------------------------------------------------------------------


def test_equal_configs_hash_equal() -> None:
    a = EngineConfig.from_kwargs(**NON_DEFAULT)
    b = EngineConfig.from_kwargs(**NON_DEFAULT)
    assert a is not b
    assert a.compute_hash() == b.compute_hash()
    assert EngineConfig().compute_hash() == EngineConfig.from_kwargs().compute_hash()


@pytest.mark.parametrize("name", sorted(NON_DEFAULT))
def test_changing_one_field_changes_the_hash(name: str) -> None:
    changed = EngineConfig.from_kwargs(**{name: NON_DEFAULT[name]})
    assert changed.compute_hash() != EngineConfig().compute_hash()


def test_hashes_of_all_single_field_changes_are_distinct() -> None:
    hashes = [EngineConfig().compute_hash()] + [
        EngineConfig.from_kwargs(**{n: v}).compute_hash() for n, v in NON_DEFAULT.items()
    ]
    assert len(set(hashes)) == len(hashes)


# --- ParallelConfig validation ---------------------------------------------------------------


def test_tensor_parallel_size_above_one_is_refused() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        ParallelConfig(tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig.from_kwargs(tensor_parallel_size=2)


@pytest.mark.parametrize(
    "backend",
    [
        "mp",
        "ray",
        "",
        "corefleet.engine.worker.null_executor.NullExecutor",
        "corefleet.engine.worker.null_executor:",
        ":NullExecutor",
    ],
)
def test_executor_backend_must_be_uni_or_module_colon_class(backend: str) -> None:
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        ParallelConfig(distributed_executor_backend=backend)


def test_valid_executor_backends_are_accepted() -> None:
    assert ParallelConfig(distributed_executor_backend="uni").distributed_executor_backend == "uni"
    cfg = ParallelConfig(distributed_executor_backend=NULL_EXECUTOR)
    assert cfg.distributed_executor_backend == NULL_EXECUTOR


def test_unknown_kwarg_is_a_type_error_listing_accepted_names() -> None:
    with pytest.raises(TypeError, match="max_num_seqs"):
        EngineConfig.from_kwargs(max_num_sequences=4)


# --- resolve_executor_class ------------------------------------------------------------------


def test_resolve_uni_executor() -> None:
    from corefleet.engine.worker.executor import UniProcExecutor, resolve_executor_class

    assert resolve_executor_class("uni") is UniProcExecutor


def test_resolve_module_colon_class() -> None:
    from corefleet.engine.worker.executor import resolve_executor_class
    from corefleet.engine.worker.null_executor import NullExecutor

    assert resolve_executor_class(NULL_EXECUTOR) is NullExecutor


@pytest.mark.parametrize(
    "backend",
    [
        "corefleet.engine.worker.no_such_module:NullExecutor",
        "corefleet.engine.worker.null_executor:NoSuchExecutor",
        "corefleet.engine.transport.sockets:HEARTBEAT_IVL_MS",  # importable, but not a class
    ],
)
def test_unresolvable_backend_names_the_value(backend: str) -> None:
    from corefleet.engine.worker.executor import resolve_executor_class

    with pytest.raises(ValueError) as info:
        resolve_executor_class(backend)
    assert backend in str(info.value)


# --- engine-core --help ----------------------------------------------------------------------


def test_engine_core_help_lists_its_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["engine-core", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in (
        "--coordinator",
        "--rank",
        "--shutdown-mode",
        "--shutdown-timeout",
        "--curve-keys-dir",
        # and the engine flags it shares with generate/chat
        "--model",
        "--num-gpu-blocks-override",
        "--distributed-executor-backend",
    ):
        assert flag in out, flag


def test_engine_core_requires_a_coordinator(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["engine-core"])
    assert info.value.code == 2
    assert "--coordinator" in capsys.readouterr().err
