"""Load balancing over real ranks: spreading, drains that lose nothing, deaths that migrate."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from pathlib import Path

import pytest

from corefleet.engine.coordinator.fleet_client import FleetClient
from corefleet.engine.coordinator.routing import make_policy
from corefleet.engine.messages import EngineCoreRequest, FinishReason
from tests.engine_proc_support import greedy, spawn_rank, until
from tests.fixtures_models import write_tiny_llama

pytestmark = pytest.mark.slow

PROMPT = [5, 6, 7, 8]
TOKENS = 200


async def _collect(fleet: FleetClient, request: EngineCoreRequest) -> tuple[list[int], str]:
    tokens: list[int] = []
    reason = ""
    async for output in fleet.generate(request):
        tokens += output.new_token_ids
        if output.finished:
            reason = str(output.finish_reason)
    return tokens, reason


def test_requests_spread_survive_a_drain_and_migrate_off_a_dead_rank(tmp_path: Path) -> None:
    model = write_tiny_llama(tmp_path / "m")
    procs: list[subprocess.Popen[bytes]] = []

    async def scenario() -> None:
        fleet = FleetClient(
            policy=make_policy("least-loaded"),
            max_migrations=2,
            bind_host="127.0.0.1",
            advertise_host="127.0.0.1",
            ports=(0, 0, 0),
            heartbeat_timeout_s=2.0,
        )
        await fleet.start()
        try:
            port = fleet.server.ports[0]
            procs.extend(spawn_rank(model, port, r) for r in (0, 1))
            await until(lambda: len(fleet.membership.accepting()) == 2, 90, "two ranks ready")

            # Greedy reference, then 8 concurrent copies: spread over both ranks, all equal.
            reference, _ = await _collect(fleet, EngineCoreRequest("ref", PROMPT, greedy(TOKENS)))
            assert len(reference) == TOKENS
            requests = [EngineCoreRequest(f"spread-{i}", PROMPT, greedy(TOKENS)) for i in range(8)]
            results = await asyncio.gather(*(_collect(fleet, r) for r in requests))
            assert all(tokens == reference and reason == "length" for tokens, reason in results)
            # Both ranks served: their step counters arrive with their periodic stats, which
            # may come after the last output, so poll for them.
            await until(
                lambda: all(m.stats.step_counter > 0 for m in fleet.membership.accepting()),
                30,
                "both ranks' stats to show steps",
            )

            # Kill rank 1 while it streams: its requests continue on rank 0, token for token.
            streams = [
                asyncio.create_task(
                    _collect(fleet, EngineCoreRequest(f"kill-{i}", PROMPT, greedy(TOKENS)))
                )
                for i in range(6)
            ]
            await until(
                lambda: any(
                    s.rank == 1 and len(s.generated) >= 3 for s in fleet._requests.values()
                ),
                10,
                "rank 1 streaming",
            )
            os.kill(procs[1].pid, signal.SIGKILL)
            outcomes = await asyncio.wait_for(asyncio.gather(*streams), timeout=30)
            assert all(reason == "length" for _, reason in outcomes)
            assert all(tokens == reference for tokens, _ in outcomes)
            assert fleet.counters.migrations >= 1

            # Drain rank 0 while it streams and a new rank 1 joins: nothing fails.
            procs.append(spawn_rank(model, port, 1))
            await until(lambda: len(fleet.membership.accepting()) == 2, 90, "rank 1 back")
            streams = [
                asyncio.create_task(
                    _collect(fleet, EngineCoreRequest(f"drain-{i}", PROMPT, greedy(TOKENS)))
                )
                for i in range(6)
            ]
            # Drain a rank that holds some of them: rank 0 streaming, as rank 1 was above.
            await until(
                lambda: any(
                    s.rank == 0 and len(s.generated) >= 1 for s in fleet._requests.values()
                ),
                10,
                "rank 0 streaming",
            )
            procs[0].send_signal(signal.SIGTERM)
            late = [
                asyncio.create_task(
                    _collect(fleet, EngineCoreRequest(f"late-{i}", PROMPT, greedy(20)))
                )
                for i in range(6)
            ]
            outcomes = await asyncio.wait_for(asyncio.gather(*streams, *late), timeout=60)
            assert all(reason == "length" for _, reason in outcomes), outcomes
            assert all(tokens == reference for tokens, _ in outcomes[:6])
            assert procs[0].wait(timeout=30) == 0
        finally:
            await fleet.close()

    try:
        asyncio.run(scenario())
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)


def test_a_request_fails_clearly_when_no_rank_ever_comes(tmp_path: Path) -> None:
    async def scenario() -> tuple[list[int], str]:
        fleet = FleetClient(
            policy=make_policy("round-robin"),
            wait_for_rank_s=0.5,
            bind_host="127.0.0.1",
            advertise_host="127.0.0.1",
            ports=(0, 0, 0),
        )
        await fleet.start()
        try:
            return await _collect(fleet, EngineCoreRequest("lonely", PROMPT, greedy(5)))
        finally:
            await fleet.close()

    tokens, reason = asyncio.run(scenario())
    assert tokens == [] and reason == str(FinishReason.ERROR)


def test_prefix_aware_routing_keeps_a_repeated_prefix_on_one_rank(tmp_path: Path) -> None:
    model = write_tiny_llama(tmp_path / "m")
    procs: list[subprocess.Popen[bytes]] = []
    shared = [5 + (i * 7) % 250 for i in range(64)]  # 16 blocks of 4 tokens

    async def scenario() -> tuple[list[int], list[int]]:
        fleet = FleetClient(
            policy=make_policy("prefix-aware", block_size=4),
            bind_host="127.0.0.1",
            advertise_host="127.0.0.1",
            ports=(0, 0, 0),
        )
        await fleet.start()
        try:
            procs.extend(spawn_rank(model, fleet.server.ports[0], r) for r in (0, 1))
            await until(lambda: len(fleet.membership.accepting()) == 2, 90, "two ranks ready")

            async def rank_of(request: EngineCoreRequest) -> int:
                stream = fleet.generate(request)
                await anext(stream)  # routed and producing
                rank = fleet.rank_of(request.request_id)
                async for _ in stream:
                    pass
                assert rank is not None
                return rank

            same = [
                await rank_of(EngineCoreRequest(f"p{i}", [*shared, 300 + i], greedy(2)))
                for i in range(6)
            ]
            # Unrelated prompts still spread over both ranks.
            other = [
                await rank_of(EngineCoreRequest(f"o{i}", [7 + i, 9, 11 + i], greedy(2)))
                for i in range(6)
            ]
            return same, other
        finally:
            await fleet.close()

    try:
        same, other = asyncio.run(scenario())
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)
    assert len(set(same)) == 1, same
    assert set(other) == {0, 1}, other
