"""What benchmarks/operator_scale.py measures and prints: process figures from /proc, the
operator's reconciles and audited requests per phase, and the table."""

from __future__ import annotations

import collections
import math
import os
import pathlib
from typing import Any


def _cmd_name(pid: int) -> str:
    try:
        argv = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    name = os.path.basename(argv[0].decode(errors="replace"))
    if name.startswith("python") and len(argv) > 1:
        return os.path.basename(argv[1].decode(errors="replace"))
    return name


class ProcessStats:
    """CPU seconds of this process's children by program name, and one process's memory."""

    TICK = os.sysconf("SC_CLK_TCK")

    def children(self) -> dict[str, int]:
        """Program name -> pid of the direct children of this process."""
        me, out = os.getpid(), {}
        for entry in pathlib.Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[1]) == me:
                name = _cmd_name(int(entry.name))
                out["operator" if name == "operator_timing.py" else name] = int(entry.name)
        return out

    def cpu(self) -> dict[str, float]:
        """Program name -> CPU seconds (user + system) so far; also "benchmark" (this process
        and the children it has waited for: kubectl) and "machine" (every core's busy time,
        whoever used it: this machine is shared)."""
        own = os.times()
        fields = pathlib.Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        busy = sum(int(v) for i, v in enumerate(fields[:8]) if i not in (3, 4))  # not idle, iowait
        mine = own.user + own.system + own.children_user + own.children_system
        out = {"benchmark": mine, "machine": busy / self.TICK}
        for name, pid in self.children().items():
            try:
                stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            out[name] = (int(fields[11]) + int(fields[12])) / self.TICK
        return out

    @staticmethod
    def memory(pid: int) -> dict[str, int]:
        """VmRSS and VmHWM of a process, in KiB."""
        out = {}
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0])
        return out


def pct(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def ms(values: list[float], q: float) -> float | None:
    """The q-th percentile of seconds, in milliseconds (one decimal); None for no values."""
    value = pct(values, q)
    return None if value is None else round(value * 1000, 1)


def summarize(records: list[dict], audit: list[dict], start: float, end: float) -> dict:
    """Reconciles and audited requests of the operator in [start, end) (Unix seconds)."""
    recs = [r for r in records if start <= r["t"] < end]
    reqs = [a for a in audit if start <= a["t"] < end]
    seconds = [r["s"] for r in recs]
    calls = [a["latency"] for a in reqs if a["verb"] != "watch"]
    return {
        "seconds": round(end - start, 2),
        "reconciles": len(recs),
        "reconcile_errors": collections.Counter(r["error"] for r in recs if r["error"]),
        "reconcile_p50_ms": ms(seconds, 50),
        "reconcile_p99_ms": ms(seconds, 99),
        "reconcile_max_ms": None if not recs else round(max(seconds) * 1000, 1),
        "client_requests_per_reconcile": None
        if not recs
        else round(sum(r["requests"] for r in recs) / len(recs), 2),
        "api_requests": len(reqs),
        "api_latency_p50_ms": ms(calls, 50),
        "api_latency_p99_ms": ms(calls, 99),
        "api_requests_per_reconcile": None if not recs else round(len(reqs) / len(recs), 2),
        "api_requests_by_agent": dict(collections.Counter(a["agent"] for a in reqs)),
        "api_requests_by_verb": dict(collections.Counter(a["verb"] for a in reqs)),
        "api_codes": dict(collections.Counter(str(a["code"]) for a in reqs)),
    }


def pod_summary(latencies: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    """p50/p99 seconds of each pod latency, per component (Tracker.pod_latencies)."""
    out: dict[str, Any] = {}
    for component, kinds in sorted(latencies.items()):
        for kind, values in kinds.items():
            if values:
                out[f"{component}_{kind}_p50_s"] = round(pct(values, 50) or 0, 2)
                out[f"{component}_{kind}_p99_s"] = round(pct(values, 99) or 0, 2)
        out[f"{component}_pods"] = len(kinds["schedule"])
    return out


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds per program between two `ProcessStats.cpu()` readings; "others": what the
    machine spent beyond this benchmark and the processes it started."""
    out = {k: round(after[k] - before.get(k, 0.0), 1) for k in sorted(after)}
    out["others"] = round(out["machine"] - sum(v for k, v in out.items() if k != "machine"), 1)
    return out


def _get(result: dict, path: str) -> Any:
    value: Any = result
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


ROWS = [
    ("apply -> all children (s)", "apply_to_children_s"),
    ("apply -> all engines Ready (s)", "apply_to_ready_s"),
    ("  last engine created -> all children (s)", "last_created_to_children_s"),
    ("  one engine: created -> children p50 (s)", "engine_children_p50_s"),
    ("  one engine: created -> children p99 (s)", "engine_children_p99_s"),
    ("  one engine: children -> Ready p50 (s)", "engine_children_to_ready_p50_s"),
    ("  one engine: children -> Ready p99 (s)", "engine_children_to_ready_p99_s"),
    ("  rank pod: created -> bound p99 (s)", "pods_create.engine_schedule_p99_s"),
    ("  rank pod: bound -> Ready (kwok) p99 (s)", "pods_create.engine_kwok_p99_s"),
    ("  kubectl apply itself (s)", "kubectl_apply_s"),
    ("API latency p50, create (ms, server side)", "create.api_latency_p50_ms"),
    ("API latency p99, create (ms, server side)", "create.api_latency_p99_ms"),
    ("reconcile p50, create phase (ms)", "create.reconcile_p50_ms"),
    ("reconcile p99, create phase (ms)", "create.reconcile_p99_ms"),
    ("reconciles, create phase", "create.reconciles"),
    ("API requests, create phase", "create.api_requests"),
    ("  per reconcile (all of the operator's)", "create.api_requests_per_reconcile"),
    ("  per reconcile (its own client only)", "create.client_requests_per_reconcile"),
    ("reconciles / s, steady", "=steady.reconciles"),
    ("API requests / s, steady", "=steady.api_requests"),
    ("operator CPU, create phase (s)", "cpu_create_s.operator"),
    ("operator CPU, steady (% of a core)", "%cpu_steady_s.operator"),
    ("operator peak RSS, VmHWM (MiB)", "memory_end_kib.VmHWM"),
    ("operator RSS after steady, VmRSS (MiB)", "memory_steady_kib.VmRSS"),
    ("rollout: apply -> all ranks replaced, Ready (s)", "rollout_s"),
    ("  kubectl apply itself (s)", "rollout_kubectl_apply_s"),
    ("  last engine changed -> all replaced (s)", "last_changed_to_rolled_s"),
    ("  one engine: changed -> replaced p50 (s)", "rollout_engine_p50_s"),
    ("  one engine: changed -> replaced p99 (s)", "rollout_engine_p99_s"),
    ("  rank pod: bound -> Ready (kwok) p50 (s)", "pods_rollout.engine_kwok_p50_s"),
    ("  API latency p50 (ms, server side)", "rollout.api_latency_p50_ms"),
    ("reconcile p50, rollout (ms)", "rollout.reconcile_p50_ms"),
    ("reconcile p99, rollout (ms)", "rollout.reconcile_p99_ms"),
    ("API requests, rollout", "rollout.api_requests"),
    ("  per reconcile (all of the operator's)", "rollout.api_requests_per_reconcile"),
    ("machine CPU busy, create (% of all cores)", "%cpu_create_s.machine"),
    ("  other sessions' share of it (%)", "%cpu_create_s.others"),
    ("machine CPU busy, rollout (% of all cores)", "%cpu_rollout_s.machine"),
    ("  other sessions' share of it (%)", "%cpu_rollout_s.others"),
]


def cell(r: dict, path: str) -> Any:
    """A table cell: a value of `r` by dotted path; "=x.n": x.n per second of phase x;
    "%cpu_<phase>_s.p": p's CPU seconds as % of the phase (of all cores for machine/others)."""
    if path.startswith("="):
        phase, key = path[1:].split(".")
        seconds = _get(r, f"{phase}.seconds")
        value = _get(r, f"{phase}.{key}")
        return None if not seconds or value is None else round(value / seconds, 1)
    if path.startswith("%"):
        group, program = path[1:].split(".")
        phase = group.split("_")[1]
        seconds = _get(r, f"{phase}.seconds")
        value = _get(r, path[1:])
        if not seconds or value is None:
            return None
        cores = (os.cpu_count() or 1) if program in ("machine", "others") else 1
        share = round(100 * value / seconds / cores)
        return min(share, 100) if program == "machine" else share  # /proc/stat ticks vs wall
    if path.endswith("_kib.VmHWM") or path.endswith("_kib.VmRSS"):
        value = _get(r, path)
        return None if value is None else round(value / 1024)
    return _get(r, path)


def table(results: list[dict]) -> str:
    width = max(len(label) for label, _ in ROWS) + 2
    head = "".join(f"{'N=' + str(r['engines']):>12}" for r in results)
    lines = [f"{'':<{width}}{head}"]
    for label, path in ROWS:
        cells = [cell(r, path) for r in results]
        lines.append(f"{label:<{width}}" + "".join(f"{'-' if c is None else c:>12}" for c in cells))
    return "\n".join(lines)
