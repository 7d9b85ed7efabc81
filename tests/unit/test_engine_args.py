"""Engine flags <-> EngineConfig: the argv a client hands to ``corefleet engine-core`` must
rebuild exactly the config it was made from, for every argument of the table; and the CLI's own
parsing of those flags."""

from __future__ import annotations

import argparse
import dataclasses
from typing import get_args

import pytest

from corefleet.engine.cli import build_parser, parse_args
from corefleet.engine.config import (
    ENGINE_ARGS,
    AttentionBackendName,
    CacheConfig,
    DeviceConfig,
    Dtype,
    EngineArg,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SchedulingPolicy,
)
from corefleet.engine.engine_args import (
    add_engine_args,
    engine_argv_from_config,
    engine_config_from_args,
    engine_kwargs_from_args,
)
from tests.unit.engine_args_helpers import NON_DEFAULT

SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "device": DeviceConfig,
    "parallel": ParallelConfig,
}

# vLLM's flag names: the operator and users' scripts spell them so; none may change.
VLLM_FLAGS = {
    "--model",
    "--served-model-name",
    "--dtype",
    "--max-model-len",
    "--seed",
    "--runner",
    "--pooler-config",
    "--max-logprobs",
    "--max-num-seqs",
    "--max-num-batched-tokens",
    "--enable-chunked-prefill",
    "--scheduling-policy",
    "--block-size",
    "--enable-prefix-caching",
    "--kv-cache-memory",
    "--num-gpu-blocks-override",
    "--gpu-memory-utilization",
    "--device",
    "--attention-backend",
    "--tensor-parallel-size",
    "--pipeline-parallel-size",
    "--distributed-executor-backend",
    "--enable-expert-parallel",
    "--quantization",
    "--kv-cache-dtype",
}


# Extra values worth a round trip of their own.
EXTRA_CASES: dict[str, dict[str, object]] = {
    "gpu_memory_utilization=1/3": {"gpu_memory_utilization": 1 / 3},
    "gpu_memory_utilization=1.0": {"gpu_memory_utilization": 1.0},
    "dtype=float16": {"dtype": "float16"},
    "dtype=float32": {"dtype": "float32"},
    "quantization=gguf": {"quantization": "gguf"},
    "kv_cache_dtype=bfloat16": {"kv_cache_dtype": "bfloat16"},
    "num_gpu_blocks_override=2": {"num_gpu_blocks_override": 2},
    "seed=-5": {"seed": -5},
    "model=-dash-first": {"model": "-m"},
    "everything-at-once": dict(NON_DEFAULT),
}

ROUND_TRIP_CASES: dict[str, dict[str, object]] = {
    "defaults": {},
    **{name: {name: value} for name, value in NON_DEFAULT.items()},
    **EXTRA_CASES,
}

BY_KEYWORD = {arg.keyword: arg for arg in ENGINE_ARGS}


def _value(config: EngineConfig, keyword: str) -> object:
    return BY_KEYWORD[keyword].value_in(config)


def _parse_engine_core(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(["engine-core", "--coordinator", "x:1", *argv])


# --- the table -------------------------------------------------------------------------------


def test_sections_match_engine_config() -> None:
    """The section table here is EngineConfig's own: a new section must be added here too."""
    assert {f.name for f in dataclasses.fields(EngineConfig)} == set(SECTIONS)
    config = EngineConfig()
    for name, cls in SECTIONS.items():
        assert type(getattr(config, name)) is cls


def test_every_config_field_is_in_the_table() -> None:
    fields = {(s, f.name) for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    assert {(arg.section, arg.name) for arg in ENGINE_ARGS} == fields


def test_flags_are_vllms_and_keywords_follow_them() -> None:
    assert {arg.flag for arg in ENGINE_ARGS} == VLLM_FLAGS
    for arg in ENGINE_ARGS:
        assert arg.keyword == arg.flag.removeprefix("--").replace("-", "_")
        assert arg.help, arg.flag
    assert BY_KEYWORD["scheduling_policy"].name == "policy"
    assert BY_KEYWORD["num_gpu_blocks_override"].name == "num_blocks_override"


def test_every_argument_has_a_round_trip_case() -> None:
    """A new argument without a case here fails: its argv mapping is then untested."""
    keywords = set(BY_KEYWORD)
    covered = set(NON_DEFAULT)
    assert keywords - covered == set(), "arguments without a round-trip case"
    assert covered - keywords == set(), "round-trip cases for arguments that do not exist"


@pytest.mark.parametrize("name", sorted(NON_DEFAULT))
def test_non_default_value_really_differs_from_default(name: str) -> None:
    assert NON_DEFAULT[name] != BY_KEYWORD[name].default
    assert _value(EngineConfig(), name) == BY_KEYWORD[name].default


# --- config -> argv -> args -> kwargs -> config ----------------------------------------------


@pytest.mark.parametrize("kwargs", list(ROUND_TRIP_CASES.values()), ids=list(ROUND_TRIP_CASES))
def test_argv_round_trip(kwargs: dict[str, object]) -> None:
    config = EngineConfig.from_kwargs(**kwargs)
    argv = engine_argv_from_config(config)
    assert all(isinstance(a, str) for a in argv)
    engine_kwargs = engine_kwargs_from_args(_parse_engine_core(argv))
    assert set(engine_kwargs) == set(BY_KEYWORD)
    for name, value in kwargs.items():
        assert engine_kwargs[name] == value
    rebuilt = EngineConfig.from_kwargs(**engine_kwargs)
    assert rebuilt == config
    for name, value in kwargs.items():
        assert _value(rebuilt, name) == value


@pytest.mark.parametrize("name", sorted(NON_DEFAULT))
def test_argv_differs_when_one_argument_differs(name: str) -> None:
    """Each argument reaches the argv: a changed value changes the command line."""
    default_argv = engine_argv_from_config(EngineConfig())
    changed_argv = engine_argv_from_config(EngineConfig.from_kwargs(**{name: NON_DEFAULT[name]}))
    assert changed_argv != default_argv


def test_round_trip_through_a_plain_parser_with_engine_args() -> None:
    """The flags alone (no subcommand) as any command that calls add_engine_args takes them."""
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = EngineConfig.from_kwargs(**NON_DEFAULT)
    assert engine_config_from_args(parser.parse_args(engine_argv_from_config(config))) == config
    assert engine_config_from_args(parser.parse_args([])) == EngineConfig()


@pytest.mark.parametrize("arg", [a for a in ENGINE_ARGS if a.kind is bool], ids=lambda a: a.flag)
def test_boolean_flags_have_a_no_form(arg: EngineArg) -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert getattr(parser.parse_args(["--no-" + arg.flag[2:]]), arg.keyword) is False
    assert getattr(parser.parse_args([arg.flag]), arg.keyword) is True


# --- choices come from the Literal types -----------------------------------------------------


@pytest.mark.parametrize(
    "flag,literal",
    [
        ("--dtype", Dtype),
        ("--attention-backend", AttentionBackendName),
        ("--scheduling-policy", SchedulingPolicy),
    ],
)
def test_choices_are_the_literals_values(flag: str, literal: object) -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    action = next(a for a in parser._actions if flag in a.option_strings)
    assert tuple(action.choices or ()) == get_args(literal)
    for choice in get_args(literal):
        assert parser.parse_args([flag, choice]) is not None


@pytest.mark.parametrize("flag", ["--dtype", "--attention-backend", "--scheduling-policy"])
def test_a_bad_choice_is_rejected_by_argparse(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        _parse_engine_core([flag, "no-such-choice"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and "invalid choice" in err


def test_a_bad_choice_in_kwargs_is_a_value_error_listing_the_choices() -> None:
    with pytest.raises(ValueError, match=r"scheduling_policy.*fcfs, priority"):
        EngineConfig.from_kwargs(scheduling_policy="lifo")
    with pytest.raises(ValueError, match=r"dtype.*auto, float32, bfloat16, float16"):
        EngineConfig.from_kwargs(dtype="int8")


# --- serve MODEL -----------------------------------------------------------------------------


def test_serve_takes_the_model_positionally() -> None:
    assert parse_args(["serve", "/models/m"]).model == "/models/m"
    assert parse_args(["serve", "--model", "/models/m"]).model == "/models/m"
    assert parse_args(["serve", "/models/m", "--model", "/models/m"]).model == "/models/m"
    assert parse_args(["serve"]).model is None
    args = parse_args(["serve", "/models/m", "--max-num-seqs", "3", "--port", "9"])
    assert engine_config_from_args(args) == EngineConfig.from_kwargs(
        model="/models/m", max_num_seqs=3
    )


def test_serve_with_two_different_models_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(["serve", "/models/a", "--model", "/models/b"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "/models/a" in err and "/models/b" in err


def test_engine_core_takes_no_positional_model(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["engine-core", "--coordinator", "x:1", "/models/m"])
    assert "unrecognized arguments" in capsys.readouterr().err


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


def test_a_field_without_a_declaration_cannot_enter_the_table() -> None:
    """A config field added without ``metadata=engine_arg(...)`` fails at import, loudly."""
    from corefleet.engine.config_fields import engine_arg_of

    @dataclasses.dataclass(frozen=True)
    class Undeclared:
        knob: int = 3

    with pytest.raises(TypeError, match=r"Undeclared\.knob"):
        engine_arg_of("cache", Undeclared, dataclasses.fields(Undeclared)[0])
