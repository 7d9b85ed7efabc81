"""Engine flags <-> EngineConfig: the argv a client hands to ``corefleet engine-core`` must
rebuild exactly the config it was made from, for every argument of the table; the keywords
``LLM(...)`` takes are vLLM's names from the same table."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
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

NULL_EXECUTOR = "corefleet.engine.worker.null_executor:NullExecutor"

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
    "--distributed-executor-backend",
    "--quantization",
    "--kv-cache-dtype",
}

# One non-default value per engine argument, keyed by its keyword (vLLM's EngineArgs name).
NON_DEFAULT: dict[str, object] = {
    "model": "/models/My Llama/llama-3.2-1b.Q8_0.gguf",
    "served_model_name": "team/llama-small",
    "max_model_len": 4096,
    "dtype": "bfloat16",
    "quantization": "none",
    "kv_cache_dtype": "float16",
    "seed": 1234,
    "max_num_seqs": 7,
    "max_num_batched_tokens": 513,
    "enable_chunked_prefill": False,
    "scheduling_policy": "priority",
    "block_size": 32,
    "enable_prefix_caching": False,
    "kv_cache_memory": 123_456_789,
    "num_gpu_blocks_override": 64,
    "gpu_memory_utilization": 0.55,
    "device": "cpu",
    "attention_backend": "torch",
    "distributed_executor_backend": NULL_EXECUTOR,
}

# Arguments with a single valid value: they cannot be varied, only carried with their default.
SINGLE_VALUED = {"tensor_parallel_size": "--tensor-parallel-size"}

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
    covered = set(NON_DEFAULT) | set(SINGLE_VALUED)
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


@pytest.mark.parametrize("name,flag", sorted(SINGLE_VALUED.items()))
def test_single_valued_arguments_are_passed_on(name: str, flag: str) -> None:
    argv = engine_argv_from_config(EngineConfig())
    assert flag in argv
    assert argv[argv.index(flag) + 1] == str(BY_KEYWORD[name].default)


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


# --- keyword arguments with vLLM's names ------------------------------------------------------


def test_vllm_keyword_names_build_the_expected_config() -> None:
    config = EngineConfig.from_kwargs(scheduling_policy="priority", num_gpu_blocks_override=48)
    assert config.scheduler.policy == "priority"
    assert config.cache.num_blocks_override == 48
    assert config == EngineConfig(
        scheduler=SchedulerConfig(policy="priority"), cache=CacheConfig(num_blocks_override=48)
    )


def test_field_names_are_still_accepted_where_they_differ() -> None:
    assert EngineConfig.from_kwargs(policy="priority", num_blocks_override=48) == (
        EngineConfig.from_kwargs(scheduling_policy="priority", num_gpu_blocks_override=48)
    )


def test_one_setting_under_both_names_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"scheduling_policy.*twice"):
        EngineConfig.from_kwargs(policy="fcfs", scheduling_policy="priority")


def test_unknown_kwarg_is_a_type_error_naming_it() -> None:
    with pytest.raises(TypeError, match="'max_num_sequences'") as info:
        EngineConfig.from_kwargs(max_num_sequences=4)
    assert "did you mean 'max_num_seqs'" in str(info.value)
    assert "scheduling_policy" in str(info.value)  # the accepted names are listed


def test_llm_rejects_an_unknown_kwarg_before_loading_anything() -> None:
    from corefleet.engine.frontend.llm import LLM

    with pytest.raises(TypeError, match="'no_such_engine_arg'"):
        LLM("/no/such/model", no_such_engine_arg=1)


def test_llm_takes_vllm_keyword_names(tmp_path: Path) -> None:
    """A real (tiny, in-process) LLM built with vLLM's names, and a priority-ordered batch."""
    from corefleet.engine.frontend.llm import LLM
    from corefleet.engine.messages import SamplingParams
    from tests.fixtures_models import write_tiny_llama

    folder = write_tiny_llama(tmp_path / "m")
    llm = LLM(
        str(folder),
        multiprocess=False,
        dtype="float32",
        attention_backend="torch",  # the reference kernels: no C++ build needed
        block_size=4,
        scheduling_policy="priority",
        num_gpu_blocks_override=32,
    )
    try:
        core = llm.engine_client.engine
        assert core.config.scheduler.policy == "priority"
        assert core.config.cache.num_blocks_override == 32
        assert core.scheduler.kv_cache_manager.num_free_blocks == 31  # block 0 is reserved
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        outputs = llm.generate(["a", "b"], params, use_tqdm=False, priority=[1, 0])
        assert [len(o.outputs[0].token_ids) for o in outputs] == [2, 2]
    finally:
        llm.shutdown()


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


def test_a_field_without_a_declaration_cannot_enter_the_table() -> None:
    """A config field added without ``metadata=engine_arg(...)`` fails at import, loudly."""
    from corefleet.engine.config import _engine_arg_of

    @dataclasses.dataclass(frozen=True)
    class Undeclared:
        knob: int = 3

    with pytest.raises(TypeError, match=r"Undeclared\.knob"):
        _engine_arg_of("cache", Undeclared, dataclasses.fields(Undeclared)[0])
