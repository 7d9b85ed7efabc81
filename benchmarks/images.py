"""The images: their sizes and largest layers, and the time from a rank pod's creation to Ready
when it runs from the engine image (the e2e kubelet's container mode, runc) against the same
rank as a process of this machine's installation (the process mode).

Per mode, one local cluster (tests/e2e/cluster.py: the real control plane, the local kubelet,
the real operator) serves examples/smollm2-cpu.yaml with `dataParallelSize: 1`; then each run
scales to 2 replicas and times rank 1's pod from the moment its object appears to the moment
its Ready condition is True (both polled every 0.1 s), then scales back to 1. A cold run first
drops the page cache (`echo 3 > /proc/sys/vm/drop_caches`): the image's files, the model and
Python's modules come from disk again. Needs root, Docker and `make images`. Not a test:
nothing is asserted.

    .venv/bin/python benchmarks/images.py [--runs 3] [--cold-runs 2]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [
    str(ROOT / "tests" / "e2e"),
    str(ROOT / "tests" / "integration" / "operator"),
    str(ROOT / "tests" / "controlplane"),
]

from cluster import LocalCluster, wait_for  # noqa: E402
from images_support import ENGINE_IMAGE, OPERATOR_IMAGE, missing_images  # noqa: E402

NAME = "smollm2"
POD = f"{NAME}-engine-1"
TIMEOUT = 400.0


def image_report(image: str) -> str:
    size = int(subprocess.check_output(["docker", "image", "inspect", "-f", "{{.Size}}", image]))
    rows = subprocess.check_output(
        ["docker", "history", "--no-trunc", "--format", "{{json .}}", image], text=True
    ).splitlines()
    layers = []
    for row in map(json.loads, rows):
        text = row["Size"]
        number = float(text.rstrip("kMGB")) if text not in ("0B", "") else 0.0
        scale = {"kB": 1e3, "MB": 1e6, "GB": 1e9, "B": 1}[
            next(s for s in ("kB", "MB", "GB", "B") if text.endswith(s))
        ]
        layers.append((number * scale, row["CreatedBy"]))
    layers.sort(reverse=True)
    lines = [f"{image}: {size / 1e9:.2f} GB"]
    for nbytes, created_by in layers[:4]:
        step = " ".join(created_by.replace("/bin/sh -c ", "").split())[:90] or "(base image)"
        lines.append(f"    {nbytes / 1e6:8.0f} MB  {step}")
    return "\n".join(lines)


def _ready(cluster: LocalCluster) -> bool:
    pod = cluster.api.obj("v1/pods", "default", POD) or {}
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions") or ()
    )


def one_mode(containers: bool, runs: int, cold_runs: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"warm": [], "cold": []}
    example = yaml.safe_load((ROOT / "examples" / "smollm2-cpu.yaml").read_text())
    example["spec"]["dataParallelSize"] = 1
    with (
        tempfile.TemporaryDirectory() as folder,
        LocalCluster(pathlib.Path(folder), containers=containers) as cluster,
    ):
        spec = pathlib.Path(folder) / "engine.yaml"
        spec.write_text(yaml.safe_dump(example))
        cluster.kubectl("apply", "-f", str(spec))
        wait_for(lambda: cluster.api.obj("v1/pods", "default", f"{NAME}-engine-0"), 60, "rank 0")
        for kind in ["cold"] * cold_runs + ["warm"] * runs:
            if kind == "cold":
                subprocess.run(["sync"], check=True)
                pathlib.Path("/proc/sys/vm/drop_caches").write_text("3\n")
            cluster.kubectl("scale", f"ie/{NAME}", "--replicas=2")
            wait_for(lambda: cluster.api.obj("v1/pods", "default", POD), 60, "rank 1's pod", 0.1)
            created = time.monotonic()
            wait_for(lambda: _ready(cluster), TIMEOUT, "rank 1 Ready", 0.1)
            seconds = time.monotonic() - created
            out[kind].append(seconds)
            print(f"{'container' if containers else 'process'} {kind}: {seconds:.1f} s", flush=True)
            cluster.kubectl("scale", f"ie/{NAME}", "--replicas=1")
            wait_for(lambda: cluster.api.obj("v1/pods", "default", POD) is None, 120, "rank 1 gone")
            time.sleep(1)  # the kubelet removes the sandbox after the pod object
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="warm runs per mode")
    parser.add_argument("--cold-runs", type=int, default=2, help="cold runs per mode")
    args = parser.parse_args()
    why = missing_images()
    if why is not None:
        raise SystemExit(why)
    for image in (OPERATOR_IMAGE, ENGINE_IMAGE):
        print(image_report(image))
    results: dict[str, Any] = {}
    for containers in (True, False):
        mode = "image (runc)" if containers else "process"
        results[mode] = one_mode(containers, args.runs, args.cold_runs)
    print("\npod creation -> Ready, rank 1 of examples/smollm2-cpu.yaml (median, runs)")
    for mode, times in results.items():
        for kind in ("cold", "warm"):
            if times[kind]:
                median = statistics.median(times[kind])
                runs = ", ".join(f"{t:.1f}" for t in times[kind])
                print(f"  {mode:13s} {kind}: {median:5.1f} s  ({runs})")


if __name__ == "__main__":
    main()
