"""Time from `kubectl apply` to all children created, for 1 and 50 InferenceEngines.

Runs the real operator (`kopf.operator()` with corefleet's handlers) against the kmock-based API
emulator of the integration tests, on loopback, in one process. Each run starts a fresh emulator
and operator, creates N engines (2 ranks each) at once, and stops the clock when every engine has
its 2 pods and 6 other children (ConfigMap, 2 Services, PodDisruptionBudget, NetworkPolicy,
Deployment, Secret). Prints the median of several runs. Not a test: nothing here asserts a time.

    .venv/bin/python benchmarks/operator_reconcile.py [--runs 5] [--sizes 1 50]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import pathlib
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integration" / "operator"))
os.environ.setdefault("COREFLEET_OPERATOR_ADMIN_PROBE", "0")  # no coordinator runs here

from emulated_cluster import emulated_cluster  # noqa: E402
from operator_harness import IE_URL, engine_manifest, run  # noqa: E402
from operator_run import running_operator  # noqa: E402

CHILD_PATHS = (
    "v1/services",
    "v1/configmaps",
    "v1/secrets",
    "apps/v1/deployments",
    "policy/v1/poddisruptionbudgets",
    "networking.k8s.io/v1/networkpolicies",
)
CHILDREN_PER_ENGINE = 2 + 7  # 2 rank pods; 2 Services, ConfigMap, Secret, Deployment, PDB, NP


def _created(emu) -> int:
    return len(emu.objs("v1/pods")) + sum(len(emu.objs(p)) for p in CHILD_PATHS)


async def one_run(engines: int, kubeconfig: pathlib.Path, timeout: float = 120.0) -> float:
    """Seconds from the first apply to the last child of `engines` engines."""
    async with emulated_cluster(kubeconfig) as c, running_operator():
        manifests = [engine_manifest(name=f"engine-{i:03d}", ranks=2) for i in range(engines)]
        want = engines * CHILDREN_PER_ENGINE
        started = time.perf_counter()
        await asyncio.gather(*(c.request("POST", IE_URL, m) for m in manifests))
        deadline = started + timeout
        while _created(c.emu) < want:
            if time.perf_counter() > deadline:
                raise TimeoutError(f"{_created(c.emu)}/{want} children after {timeout}s")
            await asyncio.sleep(0.005)
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per size (median reported)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 50])
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            times = [
                run(one_run(size, pathlib.Path(tmp) / "kubeconfig"), timeout=300)
                for _ in range(args.runs)
            ]
            print(
                f"{size:3d} InferenceEngine(s): apply -> all {size * CHILDREN_PER_ENGINE} "
                f"children: median {statistics.median(times) * 1000:.0f} ms "
                f"(min {min(times) * 1000:.0f}, max {max(times) * 1000:.0f}, "
                f"{args.runs} runs)"
            )


if __name__ == "__main__":
    main()
