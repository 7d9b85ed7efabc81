"""EngineConfig from keywords (vLLM's names, also through LLM), its hash, executor settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from corefleet.engine.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from tests.unit.engine_args_helpers import NON_DEFAULT, NULL_EXECUTOR

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


def test_tensor_parallel_size_is_bounded_and_picks_the_multiprocess_executor() -> None:
    for size in (0, -1, 9, 2**31):
        with pytest.raises(ValueError, match="tensor_parallel_size"):
            ParallelConfig(tensor_parallel_size=size)
    assert ParallelConfig().executor_backend == "uni"
    assert ParallelConfig(tensor_parallel_size=2).executor_backend == "mp"
    assert ParallelConfig(distributed_executor_backend="mp").executor_backend == "mp"
    config = EngineConfig.from_kwargs(tensor_parallel_size=8)
    assert config.parallel.tensor_parallel_size == 8


@pytest.mark.parametrize(
    "backend",
    [
        "ray",
        "",
        "corefleet.engine.worker.null_executor.NullExecutor",
        "corefleet.engine.worker.null_executor:",
        ":NullExecutor",
    ],
)
def test_executor_backend_must_be_uni_mp_or_module_colon_class(backend: str) -> None:
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
