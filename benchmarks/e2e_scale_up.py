"""Time from `kubectl scale ie/smollm2 --replicas=2` to the new rank serving, phase by phase.

Uses the e2e tests' local cluster (tests/e2e/cluster.py): the emulated kube-apiserver, a local
kubelet that runs pods as real processes in network namespaces, and the real operator. It
applies examples/smollm2-cpu.yaml (the embedded SmolLM2-135M) with `dataParallelSize: 1`, waits
until it serves, and then per run scales to 2 replicas, as test_smollm2_fleet.py does, and
records, from the scale command:

- pod: the rank-1 Pod object exists in the API server (the operator reacted);
- process: its container's process started (the kernel's start time in /proc/<pid>/stat);
- rank ready: the rank's own "ready X s after process start" log line, with its breakdown
  (imports, handshake, model, KV cache, ready), its C++ CPU ops line (prebuilt / JIT /
  unavailable) and its CPU threads line;
- joined: the coordinator's /admin/engines reports rank 1 `ready` (it takes requests);
- pod Ready: the kubelet's readiness probe passed; status 2/2: the InferenceEngine's status
  says RANKS 2/2 and Ready (what `kubectl get ie` shows);
- served: a request served by rank 1 has ended (two requests at a time until rank 1's step
  counter in /admin/engines advances; the coordinator routes the second to the idle rank).

Then it scales back to 1 and waits until the rank-1 pod and its process are gone. Prints each
run and the median of every phase. Needs root and kubectl, as the e2e tests do. Every process
is stopped at the end, also on errors, Ctrl-C and SIGTERM. Not a test: nothing is asserted.

    .venv/bin/python benchmarks/e2e_scale_up.py [--runs 3]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import pathlib
import re
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from typing import Any

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
# tests/e2e is not a package: its conftest puts these two folders on sys.path; so do we.
sys.path[:0] = [str(ROOT / "tests" / "e2e"), str(ROOT / "tests" / "integration" / "operator")]

from cluster import LocalCluster, wait_for  # noqa: E402
from netns import can_create_namespaces  # noqa: E402

NAME, MODEL, NS = "smollm2", "SmolLM2-135M-Instruct", "default"
EXAMPLE = ROOT / "examples" / "smollm2-cpu.yaml"
IE_PATH = "corefleet.dev/v1alpha1/inferenceengines"
POD = f"{NAME}-engine-1"
READY_RE = re.compile(r"rank 1: ready ([\d.]+) s after process start: (.*)")
OPS_RE = re.compile(r"C\+\+ CPU ops.*")
THREADS_RE = re.compile(r"rank 1: .*OpenMP wait policy.*")  # its CPU threads, for context
TIMEOUT = 300.0  # a rank loading SmolLM2 on a busy 2-core machine
PHASES = ("pod", "process", "rank ready", "joined", "pod Ready", "status 2/2", "served")


def now() -> float:
    # CLOCK_BOOTTIME is the clock of /proc/uptime and of a process's start time in /proc.
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def process_start(pid: int) -> float | None:
    """When `pid` started, on the CLOCK_BOOTTIME scale (clock-tick resolution), or None."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 22 follows the command name, which is in parentheses and may contain spaces.
    return int(stat.rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")


def engine_status(cluster: LocalCluster) -> tuple[str, str]:
    """(rankSummary, Ready condition status) of the InferenceEngine."""
    status: dict[str, Any] = (cluster.api.emu.obj(IE_PATH, NS, NAME) or {}).get("status") or {}
    conditions = status.get("conditions") or ()
    ready: dict[str, Any] = next((c for c in conditions if c.get("type") == "Ready"), {})
    return status.get("rankSummary", ""), ready.get("status", "")


def coordinator_url(cluster: LocalCluster) -> str:
    pods = [
        p
        for p in cluster.api.emu.objs("v1/pods", NS)
        if p["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "coordinator"
        and not p["metadata"].get("deletionTimestamp")
    ]
    return f"http://{pods[0]['status']['podIP']}:8000"


def rank1(base: str) -> dict[str, Any] | None:
    """Rank 1's entry in the coordinator's /admin/engines, or None."""
    with urllib.request.urlopen(f"{base}/admin/engines", timeout=5) as resp:
        return next((e for e in json.load(resp) if e["rank"] == 1), None)


def steps(entry: dict[str, Any] | None) -> int:
    return int(((entry or {}).get("stats") or {}).get("steps") or 0)


def chat(base: str) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "List three facts about the Moon."}],
        "max_tokens": 8,
        "temperature": 0.0,
    }
    request = urllib.request.Request(
        f"{base}/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as resp:
        resp.read()


def pod_ready(pod: dict[str, Any] | None) -> bool:
    statuses = ((pod or {}).get("status") or {}).get("containerStatuses") or [{}]
    return bool(statuses[0].get("ready"))


def rank1_pid(cluster: LocalCluster) -> int | None:
    assert cluster.kubelet is not None
    try:
        worker = cluster.kubelet.worker(NS, POD)
    except RuntimeError:  # the kubelet thread changed its worker dict while we read it
        return None
    return worker.pid if worker else None


def serve_until_rank1_steps(base: str, pool: concurrent.futures.Executor) -> float:
    """Send two requests at a time until rank 1 stepped; when that round ended."""
    before, deadline = steps(rank1(base)), now() + TIMEOUT
    while now() < deadline:
        # Two at once: the coordinator counts a request in flight against its rank, so the
        # second goes to the other (idle) rank even before the next stats arrive.
        for future in [pool.submit(chat, base) for _ in range(2)]:
            future.result()
        ended = now()
        # Stats reach the coordinator at least every 0.5 s: give them a second to show.
        while now() < ended + 1.0:
            if steps(rank1(base)) > before:
                return ended
            time.sleep(0.05)
    raise TimeoutError("rank 1 served nothing")


def one_run(cluster: LocalCluster, base: str, pool: concurrent.futures.Executor) -> dict[str, Any]:
    """Scale to 2, time every phase, scale back to 1; the times in s from the scale command."""
    log_path = cluster.folder / "node" / "logs" / f"{NS}_{POD}.log"
    log_offset = log_path.stat().st_size if log_path.exists() else 0  # the log keeps all runs
    t: dict[str, float] = {}
    start = now()
    # In a thread: the operator may create the pod before kubectl itself has exited.
    scaled = pool.submit(cluster.kubectl, "scale", f"ie/{NAME}", "--replicas=2")
    deadline = start + TIMEOUT
    while "joined" not in t or "status 2/2" not in t or "pod Ready" not in t:
        if now() > deadline:
            raise TimeoutError(f"phases reached: {sorted(t)}\n{cluster.logs()}")
        pod = cluster.api.emu.obj("v1/pods", NS, POD)
        if pod is not None and "pod" not in t:
            t["pod"] = now()
        pid = rank1_pid(cluster)
        if pid is not None and "process" not in t:
            t["process"] = process_start(pid) or now()
        if "pod Ready" not in t and pod_ready(pod):
            t["pod Ready"] = now()
        if "status 2/2" not in t and engine_status(cluster) == ("2/2", "True"):
            t["status 2/2"] = now()
        if "joined" not in t and "process" in t:
            entry = rank1(base)
            if entry and entry["state"] == "ready":  # the previous run's rank 1 is dead by now
                t["joined"] = now()
        time.sleep(0.02)
    scaled.result()
    t["served"] = serve_until_rank1_steps(base, pool)
    log = log_path.read_bytes()[log_offset:].decode(errors="replace")
    ready = READY_RE.search(log)
    notes = [m.group(0) for m in (OPS_RE.search(log), THREADS_RE.search(log)) if m]
    if ready:
        t["rank ready"] = t["process"] + float(ready.group(1))
    cluster.kubectl("scale", f"ie/{NAME}", "--replicas=1")
    wait_for(lambda: cluster.api.emu.obj("v1/pods", NS, POD) is None, 120, "rank 1's pod to go")
    wait_for(lambda: rank1_pid(cluster) is None, 60, "rank 1's process to go")
    wait_for(lambda: engine_status(cluster) == ("1/1", "True"), 120, "status 1/1")
    return {
        "at": {k: v - start for k, v in t.items()},
        "breakdown": ready.group(2) if ready else "(no ready line in the rank's log)",
        "notes": notes,
    }


INTERVALS = (  # (label, from, to); from None is the scale command
    ("scale -> pod object (operator)", None, "pod"),
    ("pod -> process start (kubelet)", "pod", "process"),
    ("process -> rank ready (its log)", "process", "rank ready"),
    ("process -> joined at coordinator", "process", "joined"),
    ("joined -> served a request", "joined", "served"),
    ("scale -> served (total)", None, "served"),
    ("scale -> status 2/2", None, "status 2/2"),
)


def report(runs: list[dict[str, Any]]) -> None:
    def row(label: str, at: dict[str, float]) -> str:
        return f"{label:>8} " + " ".join(f"{at[p]:7.2f}" if p in at else "      -" for p in PHASES)

    print("\nseconds from `kubectl scale` (cumulative):")
    print(f"{'':>8} " + " ".join(f"{p[:7]:>7}" for p in PHASES))
    for i, run in enumerate(runs, 1):
        print(row(f"run {i}", run["at"]))
    common = [p for p in PHASES if all(p in r["at"] for r in runs)]
    print(row("median", {p: statistics.median(r["at"][p] for r in runs) for p in common}))
    print("\nper phase, median of the runs (s):")
    for label, a, b in INTERVALS:
        deltas = [r["at"][b] - (r["at"][a] if a else 0.0) for r in runs if b in r["at"]]
        if deltas:
            values = " / ".join(f"{d:.2f}" for d in deltas)
            print(f"  {label:34} {statistics.median(deltas):7.2f}   (runs {values})")
    for i, run in enumerate(runs, 1):
        print(f"run {i} rank 1: {run['breakdown']}")
        for note in run["notes"]:
            print(f"        {note}")


def interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="scale-ups (median reported)")
    args = parser.parse_args()
    why_not = can_create_namespaces()
    if why_not:
        sys.exit(f"cannot run the local cluster: {why_not}")
    # SIGTERM unwinds like Ctrl-C, so the cluster's exit stops every container.
    signal.signal(signal.SIGTERM, interrupt)
    manifest = yaml.safe_load(EXAMPLE.read_text())
    manifest["spec"]["dataParallelSize"] = 1
    runs: list[dict[str, Any]] = []
    with (
        tempfile.TemporaryDirectory(prefix="e2e-scale-up-") as tmp,
        # The pool outside the cluster: on an error the cluster stops first, so requests still
        # in flight fail at once instead of holding the exit up.
        concurrent.futures.ThreadPoolExecutor(4) as pool,
        LocalCluster(pathlib.Path(tmp)) as cluster,
    ):
        path = pathlib.Path(tmp) / "smollm2-1.yaml"
        path.write_text(yaml.safe_dump(manifest))
        cluster.kubectl("apply", "-f", str(path))
        wait_for(lambda: engine_status(cluster) == ("1/1", "True"), TIMEOUT, "1/1", 1.0)
        base = coordinator_url(cluster)
        chat(base)  # rank 0's first request is not part of any run
        for i in range(args.runs):
            runs.append(one_run(cluster, base, pool))
            print(f"run {i + 1}: " + ", ".join(f"{k} {v:.2f}" for k, v in runs[-1]["at"].items()))
        # Delete as a user would, so the ranks drain and exit by themselves.
        cluster.kubectl("delete", "ie", NAME, "--timeout=120s", timeout=150)
        wait_for(lambda: not cluster.api.emu.objs("v1/pods", NS), 120, "every pod to go")
    report(runs)


if __name__ == "__main__":
    main()
