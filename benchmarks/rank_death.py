"""Death-to-migration time: how long after a rank's SIGKILL its stream continues elsewhere.

Runs the coordinator's routing core (``FleetClient`` and its ``FleetServer``) in this process
and two ``corefleet engine-core`` ranks on a tiny random Llama (or ``--model``). Per run: two
greedy streams start (round robin: one per rank), and once the one on rank 1 has streamed a
few tokens, rank 1 gets SIGKILL. Measured from the kill: until the coordinator marks rank 1
dead, and until the stream's next token arrives from rank 0 (the migrated request's first
token: detection plus re-dispatch plus a prefill of prompt and tokens so far). Rank 1 is then
started again and the next run waits for it. Two modes, ``--runs`` deaths each, medians:

- ``heartbeat``: death noticed by the heartbeat timeout alone (before: ``watch_connections``
  off, ``--heartbeat-timeout`` as the coordinator's default, 10 s);
- ``connection``: the socket monitor sees the killed process's TCP connections close (now).

    python benchmarks/rank_death.py --runs 5
    python benchmarks/rank_death.py --runs 5 --modes connection
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from corefleet.engine.coordinator.fleet_client import FleetClient
from corefleet.engine.coordinator.membership import RankState
from corefleet.engine.coordinator.routing import make_policy
from corefleet.engine.messages import EngineCoreRequest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.engine_proc_support import greedy, spawn_rank, until
from tests.fixtures_models import write_tiny_llama

VICTIM, SURVIVOR = 1, 0
PROMPT = [5, 6, 7, 8]


@dataclass
class Death:
    to_dead_s: float
    to_migrated_s: float


async def _one_death(fleet: FleetClient, procs: list[subprocess.Popen[bytes]], run: int) -> Death:
    killed_at = 0.0
    victim_id = ""
    migrated_at: list[float] = []

    async def stream(request_id: str) -> None:
        request = EngineCoreRequest(request_id, PROMPT, greedy(300))
        async for _ in fleet.generate(request):
            # The victim's stream, answered by the survivor: the migrated request's first token.
            answered = fleet.rank_of(request_id) == SURVIVOR
            if request_id == victim_id and killed_at and answered and not migrated_at:
                migrated_at.append(time.monotonic())

    ids = [f"run{run}-{i}" for i in range(2)]
    tasks = [asyncio.create_task(stream(i)) for i in ids]
    await until(lambda: all(fleet.rank_of(i) is not None for i in ids), 60, "both routed")
    victim_id = next(i for i in ids if fleet.rank_of(i) == VICTIM)
    state = fleet._requests[victim_id]
    await until(lambda: len(state.generated) >= 3, 60, "the victim's stream")
    assert state.rank == VICTIM
    member = fleet.membership.members[VICTIM]
    killed_at = time.monotonic()
    os.kill(procs[VICTIM].pid, signal.SIGKILL)
    while member.state is not RankState.DEAD:
        await asyncio.sleep(0.001)
    dead_at = time.monotonic()
    await asyncio.wait_for(asyncio.gather(*tasks), 120)
    procs[VICTIM].wait()
    return Death(dead_at - killed_at, migrated_at[0] - killed_at)


async def _mode(model: Path, watch: bool, runs: int, heartbeat_s: float) -> list[Death]:
    fleet = FleetClient(
        policy=make_policy("round-robin"),
        bind_host="127.0.0.1",
        advertise_host="127.0.0.1",
        ports=(0, 0, 0),
        heartbeat_timeout_s=heartbeat_s,
        watch_connections=watch,
    )
    await fleet.start()
    port = fleet.server.ports[0]
    procs = [spawn_rank(model, port, rank) for rank in (0, 1)]
    deaths = []
    try:
        for run in range(runs):
            await until(lambda: len(fleet.membership.accepting()) == 2, 300, "two ranks ready")
            deaths.append(await _one_death(fleet, procs, run))
            procs[VICTIM] = spawn_rank(model, port, VICTIM)
    finally:
        await fleet.close()
        for proc in procs:
            proc.kill()
            proc.wait()
    return deaths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--modes", nargs="+", default=["heartbeat", "connection"])
    parser.add_argument("--heartbeat-timeout", type=float, default=10.0)
    parser.add_argument("--model", type=Path, default=None, help="default: a tiny random Llama")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or write_tiny_llama(Path(tmp) / "tiny")
        for mode in args.modes:
            deaths = asyncio.run(
                _mode(model, mode == "connection", args.runs, args.heartbeat_timeout)
            )
            dead = [d.to_dead_s * 1000 for d in deaths]
            moved = [d.to_migrated_s * 1000 for d in deaths]
            print(
                f"{mode:>10}: kill -> dead median {statistics.median(dead):8.1f} ms "
                f"(runs {', '.join(f'{x:.0f}' for x in dead)}); kill -> stream continues "
                f"median {statistics.median(moved):8.1f} ms "
                f"(runs {', '.join(f'{x:.0f}' for x in moved)})",
                flush=True,
            )


if __name__ == "__main__":
    main()
