"""The operator at scale: N InferenceEngines of 8 ranks on 100 KWOK nodes of a real control plane.

For each N (default 10, 50, 200), on a fresh cluster: kube-apiserver, controller manager and
scheduler (tests/controlplane, the release `make cluster-bin` builds) on etcd 3.6 (`make
kwok-bin`; tools/kwok/go.mod says why not Debian's 3.4, which --debian-etcd uses), KWOK's
controller (`make kwok-bin`, with kwokctl's default Stages) faking 100 tainted accelerator nodes
for the ranks and 4 untainted ones for the coordinators (the coordinator Deployment takes no
tolerations), the chart's CRD and RBAC, and the real operator process as the chart's
ServiceAccount (a TokenRequest token), with COREFLEET_OPERATOR_ADMIN_PROBE=0: no coordinator
process runs, KWOK only plays the pods. Both build scripts run first (cached). Then:

1. create: `kubectl apply -f` of N engines (dataParallelSize 8). Clocks from the apply to
   - all children: for every engine, its 8 rank pods and its coordinator pod Running and Ready
     (as KWOK reports them) and every other child the operator's `build_children` makes for
     the spec (Deployment, Services, ConfigMap, Secret, PodDisruptionBudgets, NetworkPolicy;
     the counts are printed);
   - all Ready: every engine's Ready condition True for its current generation.
   Per engine, also from its InferenceEngine appearing in the watch to its children complete.
2. steady: --steady seconds with nothing changing (the operator's timer runs every 10 s).
3. rollout: `kubectl apply` of the same engines with spec.engine.maxNumSeqs changed (a new pod
   template: every rank is replaced, one at a time per engine), until every rank pod of every
   engine is a new pod of the new spec, Ready, no old one is left, and the engine Ready again.

Reconcile time: the operator logs none, so it runs under benchmarks/operator_timing.py, which
times each reconcile (`controller._reconcile_locked`) and counts the requests it makes through
the operator's client. API requests: the API server's audit log of the operator's
ServiceAccount (every request of that user: kopf's watches, patches and Events included),
counted per phase; "per reconcile" is that count over the reconciles of the phase. Memory:
the operator's VmHWM (peak) and VmRSS after the steady window, from /proc. CPU: seconds of
each process per phase. A size that times out keeps what it measured; the next sizes still run.

    .venv/bin/python benchmarks/operator_scale.py [--sizes 10 50 200] [--json out.json]

Results and what they mean: benchmarks/README.md, "Operator at scale (KWOK)". The machine's
CPU is reported too (busy, and the share of processes this run did not start): the figures
only mean something on a machine that is otherwise quiet, or read next to those rows.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import itertools
import json
import os
import pathlib
import shutil
import signal
import sys
import tempfile
import time
from typing import Any

import yaml
from kwok_cluster import (
    FAKE,
    POOL_LABEL,
    Component,
    ControlPlane,
    audit_flags,
    build,
    fake_nodes,
    install_chart,
    nodes_ready,
    operator_kubeconfig,
    poll,
    read_audit,
    start_kwok,
)
from namespace_tracker import Tracker
from scale_report import ProcessStats, cpu_delta, pct, pod_summary, summarize, table

from corefleet.operator.curve import generate_keys
from corefleet.operator.naming import Owner
from corefleet.operator.resources import build_children
from corefleet.operator.spec import parse_spec

NAMESPACE = "bench"
RESOURCES = {
    "Service": "services",
    "ConfigMap": "configmaps",
    "Secret": "secrets",
    "Deployment": "deployments",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "NetworkPolicy": "networkpolicies",
}
# The operator's command line (after `corefleet-operator`), as the brief of issue 35 gives it.
OPERATOR_ARGS = ("--all-namespaces", "--standalone", "--liveness", "")
TIMING = pathlib.Path(__file__).with_name("operator_timing.py")


def engine_spec(ranks: int, max_num_seqs: int) -> dict[str, Any]:
    return {
        "image": "corefleet:bench",
        "model": {"path": "/models/x"},
        "dataParallelSize": ranks,
        "engine": {"maxNumSeqs": max_num_seqs},
        "nodeSelector": {POOL_LABEL: "accelerator"},
        "tolerations": [
            {"key": FAKE[0], "operator": "Equal", "value": FAKE[1], "effect": "NoSchedule"}
        ],
    }


def manifests(count: int, ranks: int, max_num_seqs: int) -> str:
    docs = [
        {
            "apiVersion": "corefleet.dev/v1alpha1",
            "kind": "InferenceEngine",
            "metadata": {"name": f"bench-{i:03d}", "namespace": NAMESPACE},
            "spec": engine_spec(ranks, max_num_seqs),
        }
        for i in range(count)
    ]
    return yaml.safe_dump_all(docs)


def expected_children(ranks: int) -> dict[str, int]:
    """Resource -> how many objects the operator makes per engine, pods aside."""
    owner = Owner(name="x", namespace=NAMESPACE, uid="0")
    built = build_children(owner, parse_spec(engine_spec(ranks, 256)), generate_keys())
    counts = collections.Counter(RESOURCES[c["kind"]] for c in built)
    return dict(sorted(counts.items()))


def children_done(expected: dict[str, int], ranks: int, coordinators: int = 1):
    def done(engine: str, t: Tracker) -> bool:
        pods = [p for p in t.children(engine, "pods") if p["ready"] and not p["terminating"]]
        if sum(p["component"] == "engine" for p in pods) < ranks:
            return False
        if sum(p["component"] == "coordinator" for p in pods) < coordinators:
            return False
        return all(len(t.children(engine, r)) >= n for r, n in expected.items())

    return done


def engine_ready(engine: str, t: Tracker) -> bool:
    found = t.state["inferenceengines"].get(engine)
    return bool(found and found["ready"])


def rolled_done(old: dict[str, list[dict[str, Any]]], ranks: int):
    old_uids = {p["uid"] for pods in old.values() for p in pods}
    old_hash = {e: {p["hash"] for p in pods} for e, pods in old.items()}

    def done(engine: str, t: Tracker) -> bool:
        pods = [p for p in t.children(engine, "pods") if p["component"] == "engine"]
        if any(p["uid"] in old_uids for p in pods):
            return False
        new = [p for p in pods if p["ready"] and not p["terminating"]]
        if sum(p["hash"] not in old_hash[engine] for p in new) < ranks:
            return False
        found = t.state["inferenceengines"].get(engine) or {}
        return bool(found.get("ready") and found.get("updated") == ranks)

    return done


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def wait(tracker: Tracker, phase: str, n: int, timeout: float, alive: list[Component]) -> dict:
    """Wait for a phase, logging progress every 30 s; the per-engine times."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            return tracker.wait_phase(phase, min(30.0, max(left, 0.0)), alive)
        except TimeoutError:
            if left <= 30.0:
                done = tracker.progress(phase)
                raise TimeoutError(f"{phase}: {done}/{n} engines after {timeout:.0f} s") from None
            log(f"  {phase}: {tracker.progress(phase)}/{n} engines")


def start_operator(cp: ControlPlane, folder: pathlib.Path, records: pathlib.Path) -> Component:
    """The operator as the chart's ServiceAccount, under operator_timing.py's stopwatch."""
    kubeconfig = operator_kubeconfig(cp, folder / "operator.kubeconfig")
    operator = Component(
        "corefleet-operator",
        [sys.executable, str(TIMING), str(records), "--", *OPERATOR_ARGS],
        cp.folder,
    )
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "COREFLEET_OPERATOR_ADMIN_PROBE": "0"}
    operator.start(env=env)
    return operator


def run_size(n: int, args: argparse.Namespace, kwok_dir: pathlib.Path, result: dict) -> None:
    """Measure one size into `result` (filled as far as it got when something fails)."""
    folder = args.workdir / f"n{n}"
    flags, audit_log = audit_flags(folder)
    records_path = folder / "reconciles.jsonl"
    expected = expected_children(args.ranks)
    result.update(engines=n, ranks=args.ranks, pods=n * (args.ranks + 1))
    with contextlib.ExitStack() as stack:
        cp = stack.enter_context(
            ControlPlane(folder / "cluster", extra_apiserver_flags=flags, start_timeout=180)
        )
        kwok = start_kwok(cp, kwok_dir, 60, args.kwok_parallelism)
        stack.callback(kwok.stop)
        nodes = fake_nodes(args.nodes, "kwok-accel", "accelerator", tainted=True)
        nodes += fake_nodes(args.coordinator_nodes, "kwok-cpu", "cpu", tainted=False)
        for body in nodes:
            cp.request("POST", "/api/v1/nodes", body, expect=201)
        poll(lambda: nodes_ready(cp, len(nodes)), 300, "the fake nodes Ready", [kwok], 1.0)
        install_chart(cp)
        cp.request("POST", "/api/v1/namespaces", {"metadata": {"name": NAMESPACE}}, expect=201)
        poll(
            lambda: cp.get(f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/default"),
            60,
            "the namespace's default ServiceAccount",
        )
        operator = start_operator(cp, folder, records_path)
        stack.callback(operator.stop)
        alive = [kwok, operator]
        poll(
            lambda: (
                {"inferenceengines", "pods"}
                <= {a["resource"] for a in read_audit(audit_log) if a["verb"] == "watch"}
            ),
            120,
            "the operator's watches",
            alive,
            interval=0.5,
        )
        tracker = stack.enter_context(Tracker(cp, NAMESPACE))
        time.sleep(2)  # the tracker's watches list first
        tracker.check()
        assert operator.process is not None
        marks: dict[str, float] = {}  # phase -> its start, Unix seconds
        try:
            phases(n, args, cp, tracker, alive, operator.process.pid, expected, marks, result)
        finally:
            marks.setdefault("end", time.time())
            records = [json.loads(x) for x in records_path.read_text().splitlines() if x]
            audit = read_audit(audit_log)
            order = [p for p in ("create", "steady", "rollout", "end") if p in marks]
            for phase, after in itertools.pairwise(order):
                result[phase] = summarize(records, audit, marks[phase], marks[after])
            events: collections.Counter[str] = collections.Counter()
            for event in cp.objs("v1/events", NAMESPACE):  # reporter and reason, with repeats
                source = event.get("reportingComponent") or (event.get("source") or {}).get(
                    "component"
                )
                events[f"{source} {event.get('reason')}"] += int(event.get("count") or 1)
            result["events_by_reason"] = dict(events.most_common())


def phases(
    n: int,
    args: argparse.Namespace,
    cp: ControlPlane,
    tracker: Tracker,
    alive: list[Component],
    pid: int,
    expected: dict[str, int],
    marks: dict[str, float],
    result: dict[str, Any],
) -> None:
    """create, steady, rollout; `marks` gets each one's start (Unix s), `result` the figures."""
    stats, folder = ProcessStats(), args.workdir / f"n{n}"
    result["memory_idle_kib"] = stats.memory(pid)
    names = [f"bench-{i:03d}" for i in range(n)]
    first = folder / "engines.yaml"
    first.write_text(manifests(n, args.ranks, 256))
    tracker.start_phase("children", children_done(expected, args.ranks), names)
    tracker.start_phase("ready", engine_ready, names)
    log(f"N={n}: applying {n} engines ({n * args.ranks} rank pods)")
    cpu, m0 = stats.cpu(), time.monotonic()
    marks["create"] = time.time()
    try:
        cp.kubectl("apply", "-f", str(first), timeout=900)
        result["kubectl_apply_s"] = round(time.monotonic() - m0, 2)
        children = wait(tracker, "children", n, args.timeout, alive)
        result["apply_to_children_s"] = round(max(children.values()) - m0, 2)
        per_engine = [children[e] - tracker.first_seen[e] for e in names]
        last = max(tracker.first_seen[e] for e in names)
        result["last_created_to_children_s"] = round(max(children.values()) - last, 2)
        result["engine_children_p50_s"] = round(pct(per_engine, 50), 2)
        result["engine_children_p99_s"] = round(pct(per_engine, 99), 2)
        ready = wait(tracker, "ready", n, args.timeout - (time.monotonic() - m0), alive)
        result["apply_to_ready_s"] = round(max(ready.values()) - m0, 2)
        gap = [ready[e] - children[e] for e in names]
        result["engine_children_to_ready_p50_s"] = round(pct(gap, 50), 2)
        result["engine_children_to_ready_p99_s"] = round(pct(gap, 99), 2)
    finally:
        marks["steady"] = time.time()
        result["cpu_create_s"] = cpu_delta(cpu, stats.cpu())
        result["memory_after_create_kib"] = stats.memory(pid)
        result["pods_create"] = pod_summary(tracker.pod_latencies(m0, time.monotonic()))
    log(f"N={n}: all Ready after {result['apply_to_ready_s']} s; steady {args.steady:.0f} s")
    cpu = stats.cpu()
    time.sleep(args.steady)
    result["cpu_steady_s"] = cpu_delta(cpu, stats.cpu())
    result["memory_steady_kib"] = stats.memory(pid)
    old = {e: tracker.snapshot(e) for e in names}
    second = folder / "engines-rollout.yaml"
    second.write_text(manifests(n, args.ranks, 128))
    tracker.start_phase("rolled", rolled_done(old, args.ranks), names)
    log(f"N={n}: rolling {n} engines (maxNumSeqs 256 -> 128)")
    cpu, m1 = stats.cpu(), time.monotonic()
    marks["rollout"] = time.time()
    try:
        cp.kubectl("apply", "-f", str(second), timeout=900)
        result["rollout_kubectl_apply_s"] = round(time.monotonic() - m1, 2)
        rolled = wait(tracker, "rolled", n, args.timeout, alive)
        result["rollout_s"] = round(max(rolled.values()) - m1, 2)
        changed = {e: tracker.spec_seen[(e, 2)] for e in names}  # generation 2: the new spec
        result["last_changed_to_rolled_s"] = round(max(rolled.values()) - max(changed.values()), 2)
        per_engine = [rolled[e] - changed[e] for e in names]
        result["rollout_engine_p50_s"] = round(pct(per_engine, 50), 2)
        result["rollout_engine_p99_s"] = round(pct(per_engine, 99), 2)
    finally:
        marks["end"] = time.time()
        result["cpu_rollout_s"] = cpu_delta(cpu, stats.cpu())
        result["memory_end_kib"] = stats.memory(pid)
        result["pods_rollout"] = pod_summary(tracker.pod_latencies(m1, time.monotonic()))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=[10, 50, 200], help="numbers of engines"
    )
    parser.add_argument("--ranks", type=int, default=8, help="dataParallelSize (default 8)")
    parser.add_argument("--nodes", type=int, default=100, help="fake accelerator nodes")
    parser.add_argument("--coordinator-nodes", type=int, default=4, help="untainted fake nodes")
    parser.add_argument(
        "--kwok-parallelism",
        type=int,
        default=16,
        help="kwok's pod and node Stage workers (default 16; kwok's own default is 4)",
    )
    parser.add_argument("--steady", type=float, default=30.0, help="steady window (s)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="per phase (s)")
    parser.add_argument("--json", type=pathlib.Path, help="write the results as JSON here")
    parser.add_argument(
        "--workdir", type=pathlib.Path, help="keep logs here (default: a temporary folder)"
    )
    parser.add_argument(
        "--debian-etcd",
        action="store_true",
        help="run the control plane's own etcd (Debian's 3.4): kwok then acts only on relists",
    )
    args = parser.parse_args()
    # SIGTERM and SIGINT (ignored by default in a background job) unwind the `with` blocks, so
    # every process this run started is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    keep = args.workdir is not None
    args.workdir = args.workdir or pathlib.Path(tempfile.mkdtemp(prefix="operator-scale-"))
    kwok_dir = build("tools/kwok/build.sh")
    control_plane = build("tools/controlplane/build.sh")
    if not args.debian_etcd:  # kube-* of the control plane, etcd 3.6 of tools/kwok (see there)
        bin_dir = args.workdir / "bin"
        bin_dir.mkdir(parents=True, exist_ok=True)
        for name in ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "etcd"):
            (bin_dir / name).unlink(missing_ok=True)
            (bin_dir / name).symlink_to((kwok_dir if name == "etcd" else control_plane) / name)
        control_plane = bin_dir
    os.environ["COREFLEET_CONTROLPLANE_BIN"] = str(control_plane)
    expected = expected_children(args.ranks)
    results: list[dict] = []
    failed = False
    for n in args.sizes:
        results.append({})
        try:
            run_size(n, args, kwok_dir, results[-1])
        except Exception as exc:  # keep the sizes measured so far
            failed = True
            log(f"N={n} failed: {exc!r}; logs in {args.workdir / f'n{n}'}")
            results[-1]["error"] = repr(exc)
    children = ", ".join(f"{k} x{v}" for k, v in expected.items())
    print(
        f"All children of one engine: {args.ranks} rank pods and 1 coordinator pod Running and"
        f" Ready; {children}.\n"
    )
    print(table(results))
    if args.json:
        out = {"expected_children": expected, "results": results}
        args.json.write_text(json.dumps(out, indent=2, default=str))
    if not keep and not failed:
        shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
