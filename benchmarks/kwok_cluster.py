"""A real control plane with KWOK's fake nodes, and what benchmarks/operator_scale.py reads off it.

- `build(script)`: run tools/controlplane/build.sh or tools/kwok/build.sh (each reuses its
  cache) and return the folder it prints.
- `audit_flags`: the API server flags of an audit log that records, at Metadata level, every
  request of the operator's ServiceAccount and nothing else; `read_audit` reads it back.
- `start_kwok`: KWOK's controller with the Stages kwokctl uses by default, managing only nodes
  annotated `kwok.x-k8s.io/node=fake`; `fake_nodes`: the node bodies.
- `install_chart`, `operator_kubeconfig`: the chart's CRD and RBAC, and a kubeconfig of its
  ServiceAccount (tests/controlplane/chart_install.py, or tests/e2e before that moved).
The control plane is tests/controlplane/control_plane.py's `ControlPlane`; nothing is mocked.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from datetime import datetime
from typing import Any

import yaml

REPO = pathlib.Path(__file__).resolve().parents[1]
for _folder in ("tests/controlplane", "tests/e2e"):
    if str(REPO / _folder) not in sys.path:
        sys.path.insert(0, str(REPO / _folder))

from control_plane import ControlPlane  # noqa: E402
from processes import Component, poll  # noqa: E402

try:  # the chart's RBAC and a ServiceAccount token: tests/controlplane/chart_install.py
    from chart_install import install_chart
    from chart_install import operator_kubeconfig as _operator_kubeconfig
except ImportError:  # where they were before: tests/e2e/operator_identity.py
    from operator_identity import install_chart
    from operator_identity import operator_kubeconfig as _operator_kubeconfig

__all__ = ["Component", "ControlPlane", "install_chart", "poll"]


def operator_kubeconfig(cp: ControlPlane, path: pathlib.Path) -> pathlib.Path:
    """A kubeconfig of the chart's ServiceAccount (a TokenRequest token), written to `path`."""
    made = _operator_kubeconfig(cp, path)
    return pathlib.Path(made[0] if isinstance(made, tuple) else made)


FAKE = ("kwok.x-k8s.io/node", "fake")  # the annotation kwok selects on, also the taint
POOL_LABEL = "bench.corefleet.dev/pool"
OPERATOR_USER = "system:serviceaccount:corefleet-system:corefleet"  # the chart's account
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    # One line per request: ResponseComplete (a watch also writes ResponseStarted).
    "omitStages": ["RequestReceived"],
    "rules": [{"level": "Metadata", "users": [OPERATOR_USER]}, {"level": "None"}],
}


def build(script: str) -> pathlib.Path:
    """Run a build script of tools/ (it reuses its cache) and return the folder it prints."""
    done = subprocess.run(
        ["bash", str(REPO / script)], stdout=subprocess.PIPE, text=True, timeout=3 * 3600
    )
    if done.returncode != 0:
        raise RuntimeError(f"{script} exited with {done.returncode}")
    return pathlib.Path(done.stdout.strip().splitlines()[-1])


def audit_flags(folder: pathlib.Path) -> tuple[list[str], pathlib.Path]:
    """The kube-apiserver flags for the operator's audit log, and the log's path."""
    folder.mkdir(parents=True, exist_ok=True)
    policy, log = folder / "audit-policy.yaml", folder / "audit.log"
    policy.write_text(yaml.safe_dump(AUDIT_POLICY))
    flags = [
        f"--audit-policy-file={policy}",
        f"--audit-log-path={log}",
        "--audit-log-format=json",
        "--audit-log-maxsize=0",  # no rotation: one file for the whole run
    ]
    return flags, log


def read_audit(log: pathlib.Path) -> list[dict[str, Any]]:
    """The audited requests, one per request: time (Unix s), verb, resource, code, agent."""
    seen: dict[str, dict[str, Any]] = {}
    if not log.exists():
        return []
    with open(log) as lines:
        for line in lines:
            event = json.loads(line)
            received = datetime.fromisoformat(event["requestReceivedTimestamp"]).timestamp()
            ref = event.get("objectRef") or {}
            sub = ref.get("subresource")
            done = datetime.fromisoformat(event["stageTimestamp"]).timestamp()
            seen[event["auditID"]] = {
                "t": received,
                "latency": done - received,  # server side; a watch's: until it ended
                "verb": event.get("verb"),
                "resource": ref.get("resource", "") + (f"/{sub}" if sub else ""),
                "code": (event.get("responseStatus") or {}).get("code"),
                "agent": (event.get("userAgent") or "").split("/")[0],
            }
    return sorted(seen.values(), key=lambda r: r["t"])


def start_kwok(
    cp: ControlPlane, kwok_dir: pathlib.Path, timeout: float, parallelism: int
) -> Component:
    """KWOK's controller against `cp` as its admin; returns once it has written its first log.
    `parallelism`: its pod Stage workers (kwok's default, 4, stands for 100 kubelets)."""
    # A KwokConfiguration from a file gets none of kwok's defaults: all of them, as v0.8.0's
    # SetObjectDefaults_KwokConfiguration sets them, but the two Stage worker counts.
    options = {
        "podPlayStageParallelism": parallelism,
        "nodePlayStageParallelism": parallelism,
        "nodeLeaseParallelism": 4,
        "podsOnNodeSyncParallelism": 1,
        "enablePodsOnNodeSyncListPager": True,
        "enablePodsOnNodeSyncStreamWatch": False,
        "enableDebuggingHandlers": True,
        "enableContentionProfiling": False,
        "enableProfilingHandler": True,
        "manageAllNodes": False,
        "nodeLeaseDurationSeconds": 40,
    }
    config = cp.folder / "kwok.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "config.kwok.x-k8s.io/v1alpha1",
                "kind": "KwokConfiguration",
                "options": options,
            }
        )
    )
    component = Component(
        "kwok",
        [
            str(kwok_dir / "kwok"),
            f"--kubeconfig={cp.kubeconfig}",
            f"--config={config}",
            f"--config={kwok_dir / 'stages.yaml'}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={FAKE[0]}={FAKE[1]}",
            "--node-lease-duration-seconds=40",  # kwokctl's default: a Lease per node
            "--cidr=10.0.0.0/16",  # pod IPs for 65,000 pods, not kwok's /24 default
        ],
        cp.folder,
    )
    component.start(env={**os.environ, "HOME": str(cp.folder)})  # no ~/.kwok/kwok.yaml read
    poll(lambda: component.tail(200).strip(), timeout, "kwok's first log line", [component])
    return component


def fake_nodes(count: int, prefix: str, pool: str, *, tainted: bool, pods: int = 110) -> list[dict]:
    """Bodies of `count` nodes that kwok manages, labelled `POOL_LABEL=pool`; `tainted`: with
    the customary kwok.x-k8s.io/node=fake:NoSchedule taint."""
    nodes = []
    for i in range(count):
        name = f"{prefix}-{i:03d}"
        capacity = {"cpu": "96", "memory": "768Gi", "pods": str(pods), "ephemeral-storage": "1Ti"}
        spec = {"taints": [{"key": FAKE[0], "value": FAKE[1], "effect": "NoSchedule"}]}
        nodes.append(
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": name,
                    "annotations": {FAKE[0]: FAKE[1], "node.alpha.kubernetes.io/ttl": "0"},
                    "labels": {
                        "kubernetes.io/hostname": name,
                        "kubernetes.io/os": "linux",
                        "kubernetes.io/arch": "amd64",
                        "type": "kwok",
                        POOL_LABEL: pool,
                    },
                },
                "spec": spec if tainted else {},
                "status": {"capacity": capacity, "allocatable": capacity},
            }
        )
    return nodes


def nodes_ready(cp: ControlPlane, count: int) -> bool:
    """At least `count` nodes report Ready=True and the controller manager has taken their
    node.kubernetes.io/not-ready taint off (until then the scheduler skips them)."""
    ready = 0
    for node in cp.objs("v1/nodes"):
        conditions = (node.get("status") or {}).get("conditions") or []
        taints = (node.get("spec") or {}).get("taints") or []
        ready += any(
            c.get("type") == "Ready" and c.get("status") == "True" for c in conditions
        ) and not any(t.get("key", "").startswith("node.kubernetes.io/") for t in taints)
    return ready >= count
