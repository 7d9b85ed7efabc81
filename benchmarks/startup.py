"""Start-up: process start to ready, for one ``corefleet engine-core`` rank.

Runs the coordinator's routing core (``FleetClient``, as ``corefleet coordinator`` does) in this
process and starts one rank of the embedded SmolLM2-135M-Instruct (or ``--model``) against it,
``--runs`` times per mode, a fresh coordinator and rank each time. Per start:

- **to READY**: wall time from just before the rank's process is spawned until the coordinator
  holds its READY (it is routable): what an autoscaled pod waits for, past the container start;
- the rank's own breakdown, from its ``ready N s after process start: imports, handshake,
  model (kernels and weights), KV cache, ready`` log line (``engine_core/startup.py``), and the
  C++ CPU ops' share of the model phase (the loader's ``C++ CPU ops: ..., loaded in N s``).

Modes, side by side in one run:

- ``prebuilt``: the C++ CPU ops prebuilt in the package (``setup.py``), the best variant for
  this CPU loaded at start;
- ``jit``: before, the ops compiled at first use, as every new pod did: ``COREFLEET_CPU_OPS=jit``
  with an empty TORCH_EXTENSIONS_DIR for every start (needs g++ and ninja).

    python benchmarks/startup.py --runs 5
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from corefleet.engine.coordinator.fleet_client import FleetClient
from corefleet.engine.coordinator.routing import make_policy

READY_LINE = re.compile(r"rank \d+: ready ([\d.]+) s after process start: (.*)$")
PHASE = re.compile(r"(.+?) ([\d.]+) s$")
OPS_LINE = re.compile(r"C\+\+ CPU ops: (.*), loaded in ([\d.]+) s$")
UNAVAILABLE = "C++ CPU ops unavailable"


@dataclass
class Start:
    to_ready_s: float  # spawn -> the coordinator holds READY
    own_s: float  # the rank's "ready N s after process start"
    phases: dict[str, float] = field(default_factory=dict)
    ops_s: float | None = None  # the loader's own time (None: no C++ ops line)


def _rank_argv(port: int, model: str | None) -> list[str]:
    corefleet = Path(sys.executable).with_name("corefleet")
    argv = [str(corefleet), "engine-core", "--coordinator", f"127.0.0.1:{port}"]
    argv += ["--rank", "0", "--health-port", "0", "--shutdown-mode", "abort"]
    return argv + (["--model", model] if model else [])


def _read_lines(stream: IO[str], lines: list[str]) -> None:
    for line in stream:
        lines.append(line.rstrip("\n"))


async def _one_start(model: str | None, env: dict[str, str]) -> Start:
    fleet = FleetClient(
        policy=make_policy("round-robin"),
        bind_host="127.0.0.1",
        advertise_host="127.0.0.1",
        ports=(0, 0, 0),
    )
    await fleet.start()
    lines: list[str] = []
    try:
        argv = _rank_argv(fleet.server.ports[0], model)
        started = time.monotonic()
        proc = subprocess.Popen(
            argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        assert proc.stderr is not None
        reader = threading.Thread(target=_read_lines, args=(proc.stderr, lines), daemon=True)
        reader.start()
        try:
            while not fleet.membership.accepting():
                if proc.poll() is not None:
                    raise RuntimeError("the rank exited:\n" + "\n".join(lines[-30:]))
                await asyncio.sleep(0.005)
            to_ready = time.monotonic() - started
            while not any(READY_LINE.search(line) for line in lines):  # logged just before
                await asyncio.sleep(0.01)
        finally:
            proc.terminate()
            proc.wait(60)
            reader.join(10)
    finally:
        await fleet.close()
    return _parse(to_ready, lines)


def _parse(to_ready: float, lines: list[str]) -> Start:
    start = Start(to_ready, 0.0)
    for line in lines:
        if UNAVAILABLE in line:
            raise RuntimeError(f"the rank ran without the C++ CPU ops: {line}")
        if match := READY_LINE.search(line):
            start.own_s = float(match.group(1))
            for part in match.group(2).split(", "):
                if phase := PHASE.match(part):
                    start.phases[phase.group(1)] = float(phase.group(2))
        if match := OPS_LINE.search(line):
            start.ops_s = float(match.group(2))
    return start


def _mode_env(mode: str, scratch: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "COREFLEET_CPU_OPS"}
    if mode == "jit":
        # A fresh, empty build folder per start: the compile a new pod paid at first use.
        extensions = Path(tempfile.mkdtemp(prefix="torch_extensions_", dir=scratch))
        env.update(COREFLEET_CPU_OPS="jit", TORCH_EXTENSIONS_DIR=str(extensions))
    return env


def _median(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}"


def _report(mode: str, starts: list[Start]) -> None:
    to_ready = [s.to_ready_s for s in starts]
    runs = ", ".join(f"{x:.2f}" for x in to_ready)
    print(f"{mode}: spawn -> READY at the coordinator, median {_median(to_ready)} s ({runs})")
    print(f"{mode}: the rank's own count, median {_median([s.own_s for s in starts])} s")
    for name in starts[0].phases:
        values = [s.phases.get(name, 0.0) for s in starts]
        print(f"{mode}:   {name:<28} median {_median(values)} s")
    ops = [s.ops_s for s in starts if s.ops_s is not None]
    if ops:
        label = "(of the model: C++ CPU ops)"
        print(f"{mode}:   {label:<28} median {statistics.median(ops):.3f} s")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--modes", nargs="+", choices=["prebuilt", "jit"], default=None)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    args = parser.parse_args()
    modes: list[str] = args.modes or ["prebuilt", "jit"]
    results: dict[str, list[Start]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory() as scratch:
        # Interleaved (prebuilt, jit, prebuilt, ...): a drift of the machine's speed hits both.
        for run in range(args.runs):
            for mode in modes:
                start = asyncio.run(_one_start(args.model, _mode_env(mode, Path(scratch))))
                results[mode].append(start)
                print(
                    f"run {run + 1} {mode}: READY after {start.to_ready_s:.2f} s "
                    f"(rank: {start.own_s:.1f} s, C++ CPU ops {start.ops_s} s)",
                    flush=True,
                )
    for mode in modes:
        _report(mode, results[mode])


if __name__ == "__main__":
    main()
