"""Tensor and pipeline parallelism on the CPU (gloo): worker processes, each on its slice or
stage of the model, give the tokens one worker gives; a worker's death ends the engine with its
name; none outlives it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from corefleet.engine import LLM, SamplingParams, StructuredOutputsParams
from corefleet.engine.client.base import EngineDeadError, MPClientOptions
from corefleet.engine.client.inproc import InprocClient
from corefleet.engine.client.mp import SyncMPClient
from corefleet.engine.coordinator.membership import RankState
from corefleet.engine.messages import EngineCoreRequest
from tests.engine_proc_support import (
    PROMPTS,
    collect,
    greedy,
    local_fleet,
    run_with_processes,
    spawn_rank,
    tiny_config,
    until,
)
from tests.fixtures_models import write_tiny_llama, write_tiny_model

pytestmark = pytest.mark.slow

TEXTS = ["Hello world", "The quick brown fox", "def add(a, b):", "Once upon a time"]


def _tokens(model: Path, params: SamplingParams, **engine_args: object) -> list[list[int]]:
    llm = LLM(
        str(model),
        multiprocess=False,
        dtype="float32",
        kv_cache_memory=8 << 20,
        block_size=4,
        **engine_args,
    )
    try:
        return [o.outputs[0].token_ids for o in llm.generate(TEXTS, params, use_tqdm=False)]
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    ("architecture", "num_kv_heads", "tied", "tp", "pp"),
    [
        ("llama", 2, False, 2, 1),  # a KV head per worker
        ("llama", 1, False, 2, 1),  # fewer KV heads than workers: each worker holds the one
        ("qwen2", 2, True, 2, 1),  # q/k/v biases, a tied LM head (vocabulary-parallel, shared)
        ("llama", 4, False, 4, 1),  # a head per worker, 4 processes on 2 cores
        ("llama", 2, False, 1, 2),  # two stages of 2 layers
        ("qwen2", 2, True, 1, 2),  # the last stage's tied head holds the embedding table
        ("llama", 1, True, 2, 2),  # 2 x 2 workers: a tensor-parallel group per stage
    ],
)
def test_greedy_tokens_equal_one_worker_s(
    tmp_path: Path, architecture: str, num_kv_heads: int, tied: bool, tp: int, pp: int
) -> None:
    model = write_tiny_model(
        tmp_path / "m",
        architecture=architecture,
        num_kv_heads=num_kv_heads,
        tie_word_embeddings=tied,
        num_hidden_layers=4,
    )
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    layout = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp}
    assert _tokens(model, params, **layout) == _tokens(model, params)


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_chunked_prefill_preemption_and_seeded_sampling_match_one_worker(
    tmp_path: Path, tp: int, pp: int
) -> None:
    model = write_tiny_llama(tmp_path / "m")
    # 8 tokens a step: every prompt is prefilled in chunks; 24 blocks of 4 tokens for four
    # requests of up to ~40 tokens: some are preempted and recomputed.
    tight = {"max_num_batched_tokens": 8, "num_gpu_blocks_override": 24}
    params = SamplingParams(max_tokens=32, temperature=0.8, seed=7, ignore_eos=True)
    layout = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp}
    assert _tokens(model, params, **layout, **tight) == _tokens(model, params, **tight)


def test_pipeline_stages_keep_two_steps_in_flight_and_constrain_outputs(tmp_path: Path) -> None:
    model = write_tiny_llama(tmp_path / "m")
    regex = StructuredOutputsParams(regex="[a-c]{3}-[0-9]{2}")
    params = [
        SamplingParams(max_tokens=20, temperature=0.0, structured_outputs=regex),
        *[SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)] * 3,
    ]
    # 4 tokens a step: prompts are prefilled in chunks, over several steps, which the stages
    # work on side by side (a decoding request waits for its token: one step at a time).
    engine_args = {"dtype": "float32", "kv_cache_memory": 8 << 20, "max_num_batched_tokens": 4}
    alone = LLM(str(model), multiprocess=False, **engine_args)
    expected = [o.outputs[0].token_ids for o in alone.generate(TEXTS, params, use_tqdm=False)]
    alone.shutdown()
    llm = LLM(str(model), multiprocess=False, pipeline_parallel_size=2, **engine_args)
    try:
        assert isinstance(llm.engine_client, InprocClient)
        engine = llm.engine_client.engine
        in_flight: list[int] = []
        launch = engine.executor.execute_model

        def counted(*args: object, **kwargs: object) -> object:
            in_flight.append(len(engine.batch_queue or ()))  # before this one joins
            return launch(*args, **kwargs)  # type: ignore[arg-type]

        engine.executor.execute_model = counted  # type: ignore[method-assign]
        outputs = llm.generate(TEXTS, params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert max(in_flight) == 1  # a second step launched while the first was in flight


def test_unseeded_random_sampling_keeps_the_workers_in_step(tmp_path: Path) -> None:
    # Each worker draws its own random numbers; worker 0's tokens are broadcast, so the
    # batches stay the same and the run ends with every request's full length.
    model = write_tiny_llama(tmp_path / "m")
    params = SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True)
    tokens = _tokens(model, params, tensor_parallel_size=2)
    assert [len(t) for t in tokens] == [24] * len(TEXTS)


def test_a_layout_the_model_cannot_split_is_refused_with_its_reason(tmp_path: Path) -> None:
    model = write_tiny_llama(tmp_path / "m")  # 4 attention heads
    with pytest.raises(ValueError, match=r"4 attention heads.*3 workers cannot split"):
        _tokens(model, SamplingParams(max_tokens=1), tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        _tokens(model, SamplingParams(max_tokens=1), tensor_parallel_size=1000)


def _workers(engine_pid: int) -> list[psutil.Process]:
    return [
        p
        for p in psutil.Process(engine_pid).children()
        if "corefleet.engine.worker.worker_proc" in " ".join(p.cmdline())
    ]


def _gone(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_for(condition: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"condition not met within {timeout} s"
        time.sleep(0.05)


def _engine(model: Path) -> SyncMPClient:
    return SyncMPClient(tiny_config(model, tensor_parallel_size=2), MPClientOptions())


def test_a_killed_worker_ends_the_engine_naming_the_worker(tmp_path: Path) -> None:
    client = _engine(write_tiny_llama(tmp_path / "m"))
    try:
        assert client.resources.process is not None
        workers = _workers(client.resources.process.pid)
        assert len(workers) == 2
        for i in range(8):
            client.add_request(EngineCoreRequest(f"r{i}", PROMPTS[i % 4], greedy(2000)))
        os.kill(workers[1].pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match=r"worker 1 \(pid \d+\) was killed by SIGKILL"):
            collect(client, {f"r{i}" for i in range(8)}, timeout=120)
        # The engine process exits, and takes its other worker with it.
        _wait_for(lambda: _gone(workers[0]), 30)
    finally:
        client.shutdown()


def test_a_worker_dying_while_the_engine_is_idle_ends_it_too(tmp_path: Path) -> None:
    client = _engine(write_tiny_llama(tmp_path / "m"))
    try:
        assert client.resources.process is not None
        worker = _workers(client.resources.process.pid)[0]
        worker.send_signal(signal.SIGTERM)  # ignored: the engine stops its workers
        worker.send_signal(signal.SIGINT)  # (a Ctrl-C reaches the whole process group)
        client.add_request(EngineCoreRequest("after", PROMPTS[0], greedy(4)))
        assert len(collect(client, {"after"})["after"].tokens) == 4  # both workers serve on
        worker.kill()
        # No step waits for the worker: the executor's watcher tells the busy loop.
        with pytest.raises(EngineDeadError, match=r"worker 0 \(pid \d+\) was killed by SIGKILL"):
            client.get_output(timeout=60)
        assert client.resources.process.wait(timeout=30) == 1
    finally:
        client.shutdown()


def test_no_worker_outlives_its_engine(tmp_path: Path) -> None:
    model = write_tiny_llama(tmp_path / "m")
    client = _engine(model)
    assert client.resources.process is not None
    workers = _workers(client.resources.process.pid)
    client.add_request(EngineCoreRequest("a", PROMPTS[0], greedy(4)))
    collect(client, {"a"})
    client.shutdown()  # an orderly stop
    _wait_for(lambda: all(_gone(w) for w in workers), 30)

    client = _engine(model)  # and a SIGKILLed engine: the workers see their stdin close
    assert client.resources.process is not None
    workers = _workers(client.resources.process.pid)
    try:
        os.kill(client.resources.process.pid, signal.SIGKILL)
        _wait_for(lambda: all(_gone(w) for w in workers), 30)
    finally:
        client.shutdown()


def test_smollm2_greedy_tokens_equal_one_worker_s_split_three_ways_or_in_two_stages() -> None:
    # SmolLM2-135M has 9 heads and 3 KV heads: 3 tensor-parallel workers (2 cannot split it),
    # and 30 layers: 2 stages of 15. Its GGUF blocks are dequantized with several workers, so
    # the single worker reads them so too.
    prompts = ["The capital of France is", "def fibonacci(n):"]
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    runs = []
    for tp, pp in ((1, 1), (3, 1), (1, 2)):
        llm = LLM(
            multiprocess=False,
            dtype="float32",
            kv_cache_memory=64 << 20,
            quantization="none",
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
        )
        try:
            runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, greedy)])
        finally:
            llm.shutdown()
    assert runs[0] == runs[1] == runs[2] and all(len(t) == 24 for t in runs[0])


def test_a_killed_worker_s_streams_migrate_to_another_rank(tmp_path: Path) -> None:
    model = write_tiny_llama(tmp_path / "m")

    async def scenario(procs: list[subprocess.Popen[bytes]]) -> None:
        async with local_fleet(heartbeat_timeout_s=3600.0) as fleet:
            for rank in (0, 1):
                procs.append(spawn_rank(model, fleet.server.ports[0], rank, tensor_parallel_size=2))
            await until(lambda: len(fleet.membership.accepting()) == 2, 120, "two ranks ready")
            reasons: list[str] = []

            async def stream(request_id: str) -> None:
                request = EngineCoreRequest(request_id, [5, 6, 7, 8], greedy(300))
                async for output in fleet.generate(request):
                    if output.finished:
                        reasons.append(str(output.finish_reason))

            tasks = [asyncio.create_task(stream(f"r{i}")) for i in range(2)]
            await until(lambda: fleet.rank_of("r1") is not None, 60, "r1 routed")
            victim = fleet.rank_of("r1")
            assert victim is not None
            await until(lambda: len(fleet._requests["r1"].generated) >= 3, 60, "r1 streaming")
            member = fleet.membership.members[victim]
            os.kill(_workers(procs[victim].pid)[1].pid, signal.SIGKILL)
            await until(lambda: member.state is RankState.DEAD, 60, "the worker's rank dead")
            assert "worker 1" in member.dead_reason and "SIGKILL" in member.dead_reason
            await until(lambda: fleet.rank_of("r1") == 1 - victim, 60, "r1 migrated")
            await asyncio.wait_for(asyncio.gather(*tasks), 120)
            assert reasons == ["length", "length"]
            assert procs[victim].wait(timeout=30) == 1

    run_with_processes(scenario)


@pytest.mark.parametrize("mode", ["drain", "abort"])
def test_sigterm_stops_a_rank_and_its_workers(tmp_path: Path, mode: str) -> None:
    model = write_tiny_llama(tmp_path / "m")

    async def scenario(procs: list[subprocess.Popen[bytes]]) -> None:
        async with local_fleet() as fleet:
            procs.append(
                spawn_rank(
                    model,
                    fleet.server.ports[0],
                    0,
                    "--shutdown-mode",
                    mode,
                    pipeline_parallel_size=2,
                )
            )
            await until(lambda: len(fleet.membership.accepting()) == 1, 120, "the rank ready")
            workers = _workers(procs[0].pid)
            assert len(workers) == 2
            request = EngineCoreRequest("r", [5, 6, 7, 8], greedy(250))
            reasons = []

            async def stream() -> None:
                async for output in fleet.generate(request):
                    if output.finished:
                        reasons.append(str(output.finish_reason))

            task = asyncio.create_task(stream())
            await until(
                lambda: "r" in fleet._requests and len(fleet._requests["r"].generated) >= 1,
                60,
                "streaming",
            )
            procs[0].send_signal(signal.SIGTERM)
            await asyncio.wait_for(task, 120)
            # Drain lets it finish; abort ends it at once (unless it was already done).
            assert reasons == ["length"] if mode == "drain" else reasons[0] in ("abort", "length")
            assert await asyncio.to_thread(procs[0].wait, 60) == 0
            await until(lambda: all(_gone(w) for w in workers), 30, "no worker left")

    run_with_processes(scenario)


def test_a_rank_that_cannot_split_its_model_says_why_in_its_termination_message(
    tmp_path: Path,
) -> None:
    model = write_tiny_llama(tmp_path / "m")  # 4 attention heads: 3 workers cannot split them
    log = tmp_path / "termination-log"
    log.touch()  # the kubelet creates it in a pod; outside one the rank writes nothing

    async def scenario(procs: list[subprocess.Popen[bytes]]) -> None:
        async with local_fleet() as fleet:
            env = {"COREFLEET_TERMINATION_LOG": str(log)}
            procs.append(
                spawn_rank(model, fleet.server.ports[0], 0, env=env, tensor_parallel_size=3)
            )
            assert await asyncio.to_thread(procs[0].wait, 120) == 1

    run_with_processes(scenario)
    said = log.read_text()
    assert said.startswith("ValueError: invalid engine argument tensor_parallel_size=3")
    assert "4 attention heads" in said
