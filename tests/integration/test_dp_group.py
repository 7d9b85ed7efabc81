"""An MoE group of two real ranks behind a real coordinator: waves, wake-ups, bad wave frames.

The ranks are ``corefleet engine-core`` processes given ``--data-parallel-size 2`` and a
loopback rendezvous; the coordinator is a FleetClient in this process. (``corefleet serve``
with such a group, rank deaths and drains: ``test_dp_group_serve.py``.)
"""

from __future__ import annotations

import asyncio
import itertools
import signal
import subprocess
from pathlib import Path

import pytest

from corefleet.engine.config import EngineConfig
from corefleet.engine.coordinator.fleet_client import FleetClient
from corefleet.engine.engine_core.dp_proc import DPEngineCoreProc, engine_class_for
from corefleet.engine.engine_core.proc import EngineCoreProc
from corefleet.engine.engine_core.proc_config import EngineProcConfig
from corefleet.engine.messages import EngineCoreRequest, EngineStats, RequestType, StartDPWave
from corefleet.engine.transport.handshake import rank_identity
from corefleet.engine.worker.dp_settings import DPGroupSettings
from tests.engine_proc_support import (
    greedy,
    local_fleet,
    reference_tokens,
    run_with_processes,
    spawn_rank,
    until,
)
from tests.fixtures_models import write_tiny_llama
from tests.fixtures_moe import write_tiny_moe
from tests.serve_support import free_port

WAIT_S = 120.0  # generous: two ranks start on a loaded 2-core machine
PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15]]
TOKENS = 24


def _group(size: int) -> EngineProcConfig:
    return EngineProcConfig("127.0.0.1:1", rank=0, data_parallel=DPGroupSettings(size=size))


def test_only_an_moe_model_with_several_ranks_forms_a_group(tmp_path: Path) -> None:
    moe = str(write_tiny_moe(tmp_path / "moe"))
    llama = str(write_tiny_llama(tmp_path / "llama"))
    assert engine_class_for(EngineConfig.from_kwargs(model=moe), _group(2)) is DPEngineCoreProc
    assert engine_class_for(EngineConfig.from_kwargs(model=moe), _group(1)) is EngineCoreProc
    # A dense model's ranks stay independent whatever they are told (as vLLM's).
    assert engine_class_for(EngineConfig.from_kwargs(model=llama), _group(2)) is EngineCoreProc
    tensor_parallel = EngineConfig.from_kwargs(model=moe, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="--tensor-parallel-size 1"):
        engine_class_for(tensor_parallel, _group(2))


def _stats(fleet: FleetClient) -> list[EngineStats | None]:
    members = fleet.membership.members
    return [members[r].stats if r in members else None for r in (0, 1)]


def _group_idle_in(fleet: FleetClient, wave: int) -> bool:
    """Both ranks idle in ``wave`` or later, with the same wave and step count."""
    a, b = _stats(fleet)
    return (
        a is not None
        and b is not None
        and not a.wave_running
        and not b.wave_running
        and a.current_wave == b.current_wave >= wave
        and a.step_counter == b.step_counter
    )


@pytest.mark.slow
def test_a_group_wakes_for_work_heals_a_lone_start_and_drops_bad_wave_frames(
    tmp_path: Path,
) -> None:
    model = write_tiny_moe(tmp_path / "m")
    expected = reference_tokens(model, PROMPTS, TOKENS)  # one rank, no group
    group = ("--data-parallel-size", "2", "--data-parallel-address", f"127.0.0.1:{free_port()}")

    async def scenario(procs: list[subprocess.Popen[bytes]]) -> None:
        async with local_fleet() as fleet:
            procs.extend(spawn_rank(model, fleet.server.ports[0], r, *group) for r in (0, 1))
            await until(lambda: len(fleet.membership.accepting()) == 2, WAIT_S, "group ready")
            assert [m.info and m.info.dp_size for m in fleet.membership.accepting()] == [2, 2]

            # Bad wave frames reach rank 1 and are dropped: undecodable, out of range.
            sender = fleet.server._input_sender
            for payload in (b"\xc1", b"\x91\xff", b"\x92\x00\xce\x00\x01\x00\x00", b"\x90"):
                sender.send_multipart([rank_identity(1), RequestType.START_DP_WAVE.value, payload])

            # A START that reaches rank 1 alone (as one a coordinator lost half of) makes it
            # run alone up to its first sync; the coordinator sees rank 0 idle in the wave
            # rank 1 runs, wakes it, and the group ends the wave together.
            assert fleet.server.send_nowait(1, RequestType.START_DP_WAVE, StartDPWave(0))
            await until(lambda: _group_idle_in(fleet, 1), WAIT_S, "the lone wave ended")
            rank0, rank1 = _stats(fleet)
            assert rank0 is not None and rank1 is not None
            assert rank0.dummy_steps == rank0.step_counter > 0  # nothing but dummy batches
            assert procs[0].poll() is None and procs[1].poll() is None

            # Requests: one to each rank (round robin), equal to one rank without a group.
            async def tokens(i: int) -> list[int]:
                request = EngineCoreRequest(f"r{i}", PROMPTS[i], greedy(TOKENS))
                return [t async for out in fleet.generate(request) for t in out.new_token_ids]

            assert await asyncio.gather(tokens(0), tokens(1)) == expected
            await until(lambda: _group_idle_in(fleet, 2), WAIT_S, "the group idle again")
            # Every wave ends on a sync: the ranks stepped the same, a whole number of syncs.
            rank0, _ = _stats(fleet)
            assert rank0 is not None and rank0.step_counter % 32 == 0

            # SIGTERM to rank 1 alone, the group idle: it wakes rank 0 (through the
            # coordinator), the sync tells rank 0 that a rank drains, and both leave together.
            procs[1].send_signal(signal.SIGTERM)
            codes = await asyncio.gather(*(asyncio.to_thread(p.wait, WAIT_S) for p in procs))
            assert codes == [0, 0]

    run_with_processes(scenario)


@pytest.mark.slow
def test_two_coordinators_drive_one_group_and_each_sees_its_waves(tmp_path: Path) -> None:
    model = write_tiny_moe(tmp_path / "m")
    expected = reference_tokens(model, PROMPTS, TOKENS)
    group = ("--data-parallel-size", "2", "--data-parallel-address", f"127.0.0.1:{free_port()}")

    async def scenario(procs: list[subprocess.Popen[bytes]]) -> None:
        async with local_fleet() as a, local_fleet() as b:
            both = f"127.0.0.1:{a.server.ports[0]},127.0.0.1:{b.server.ports[0]}"
            procs.extend(spawn_rank(model, both, r, *group) for r in (0, 1))
            for fleet in (a, b):
                await until(lambda f=fleet: len(f.membership.accepting()) == 2, WAIT_S, "ready")

            # Each coordinator believes the group idle and wakes it for its own request; the
            # ranks take the second wake-up of the same wave as a no-op.
            async def tokens(fleet: FleetClient, i: int, tag: str) -> list[int]:
                request = EngineCoreRequest(f"{tag}{i}", PROMPTS[i], greedy(TOKENS))
                return [t async for out in fleet.generate(request) for t in out.new_token_ids]

            for _ in range(2):
                got = await asyncio.gather(tokens(a, 0, "a"), tokens(b, 1, "b"))
                assert got == expected
            # Both coordinators follow the ranks: the group idle in the same wave, seen by each.
            for fleet in (a, b):
                await until(lambda f=fleet: _group_idle_in(f, 1), WAIT_S, "idle, seen by both")
            assert a.waves.view.current_wave == b.waves.view.current_wave >= 1
            assert not a.waves.view.running and not b.waves.view.running

    run_with_processes(scenario)


@pytest.mark.slow
def test_expert_parallel_ranks_keep_step_through_dummy_batches(tmp_path: Path) -> None:
    """Each rank holds half the experts, so every MoE layer of every forward pass exchanges
    tokens between the ranks: a request on one rank runs only because the idle one runs
    dummy batches in step (a missed one would hang the exchange until the timeout)."""
    model = write_tiny_moe(tmp_path / "m")
    expected = reference_tokens(model, PROMPTS, TOKENS)  # one rank holding every expert
    group = ("--data-parallel-size", "2", "--data-parallel-address", f"127.0.0.1:{free_port()}")

    async def scenario(procs: list[subprocess.Popen[bytes]]) -> None:
        async with local_fleet() as fleet:
            procs.extend(
                spawn_rank(model, fleet.server.ports[0], r, *group, enable_expert_parallel=True)
                for r in (0, 1)
            )
            await until(lambda: len(fleet.membership.accepting()) == 2, WAIT_S, "group ready")

            ids = itertools.count()

            async def tokens(i: int) -> list[int]:
                request = EngineCoreRequest(f"ep{next(ids)}", PROMPTS[i], greedy(TOKENS))
                return [t async for out in fleet.generate(request) for t in out.new_token_ids]

            assert await tokens(0) == expected[0]  # rank 0 busy (round robin), rank 1 in dummies
            await until(lambda: _group_idle_in(fleet, 1), WAIT_S, "the first wave ended")
            _, idle = _stats(fleet)
            assert idle is not None and idle.dummy_steps == idle.step_counter
            assert list(await asyncio.gather(tokens(0), tokens(1))) == expected  # both busy
            await until(lambda: _group_idle_in(fleet, 2), WAIT_S, "the second wave ended")

    run_with_processes(scenario)
