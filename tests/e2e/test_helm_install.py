"""The Helm chart installed for real: `helm install` against a real control plane, then the
operator run with the Deployment's own command line as the chart's ServiceAccount.

- cluster-wide (the README's command): the release deploys, and the operator, with exactly the
  chart's ClusterRole, turns the CPU example into every child (a 403 fails the test);
- namespaced with two replicas: a Role in the watched namespace, kopf peering, and leader
  failover when the leader is killed;
- the README's warning: after `kubectl apply -f crds/`, `helm install` refuses to adopt the CRD,
  and `--set crds.install=false` is the way.
No node runs here: the pods stay Pending, which is all the operator needs to see.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import re
import shlex
import signal
import subprocess
import time
from typing import Any

import pytest
from control_plane import REPO, ControlPlane
from e2e_support import wait_until
from operator_identity import CHART, deployment_argv, helm, operator

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
README = REPO / "README.md"
EXAMPLE = REPO / "examples" / "smollm2-cpu.yaml"
PEERING_CRDS = REPO / "crds" / "kopf-peering.yaml"
RELEASE, SYSTEM = "corefleet", "corefleet-system"
CHILDREN = [
    ("v1/pods", "smollm2-engine-0"),
    ("v1/pods", "smollm2-engine-1"),
    ("v1/services", "smollm2-coordinator"),
    ("v1/services", "smollm2-coordinators"),
    ("v1/services", "smollm2-engine"),
    ("v1/configmaps", "smollm2-engine-args"),
    ("v1/secrets", "smollm2-curve"),
    ("apps/v1/deployments", "smollm2-coordinator"),
    ("policy/v1/poddisruptionbudgets", "smollm2-engine"),
    ("policy/v1/poddisruptionbudgets", "smollm2-coordinator"),
    ("networking.k8s.io/v1/networkpolicies", "smollm2-coordinator"),
]


def run_helm(api: ControlPlane, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """The real helm against this cluster."""
    env = {**api.env(), "HELM_CACHE_HOME": str(api.folder / "helm-cache")}
    env["HELM_CONFIG_HOME"] = str(api.folder / "helm-config")
    done = subprocess.run(
        [helm(), *args], env=env, capture_output=True, text=True, timeout=180, check=False
    )
    if check and done.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} exited {done.returncode}: {done.stderr}")
    return done


def readme_helm_commands() -> list[list[str]]:
    """The README's ```bash block that runs `helm install`, a word list per command."""
    text = README.read_text()
    block = next(
        b for b in text.split("```bash\n")[1:] if b.split("```")[0].lstrip().startswith("helm")
    )
    lines = block.split("```")[0].splitlines()
    return [shlex.split(line, comments=True) for line in lines if shlex.split(line, comments=True)]


def children_missing(api: ControlPlane, namespace: str) -> list[str]:
    return [name for path, name in CHILDREN if api.obj(path, namespace, name) is None]


def assert_no_403(log: pathlib.Path) -> None:
    """No refusal in the operator's log: an HTTP 403 (kopf logs the status code) or Forbidden.
    A log line's milliseconds (`17:47:24,403`) are not a status code: CI once failed on one."""
    text = log.read_text(errors="replace")
    status = re.search(r"(?<![,\d])403(?!\d)", text)
    assert status is None and "forbidden" not in text.lower(), text[-3000:]


def test_the_readme_helm_install_runs_the_example_under_the_charts_rbac(
    tmp_path: pathlib.Path,
) -> None:
    commands = readme_helm_commands()
    assert commands[0][:2] == ["helm", "install"], commands
    with ControlPlane(tmp_path / "api", scheduler=False) as api:
        for argv in commands:
            words = [str(REPO / w) if (REPO / w).exists() else w for w in argv]
            if words[0] == "helm":
                run_helm(api, *words[1:])
            else:
                api.kubectl(*words[1:], timeout=60)
        status = json.loads(run_helm(api, "status", RELEASE, "-n", SYSTEM, "-o", "json").stdout)
        assert status["info"]["status"] == "deployed", status["info"]
        log = tmp_path / "operator.log"
        with operator(api, deployment_argv(api, SYSTEM, RELEASE), log, "only"):
            wait_until(lambda: not children_missing(api, "default"), 120, 0.5, "every child")
        assert_no_403(log)


def _peers(api: ControlPlane, namespace: str) -> dict[str, Any]:
    peering = api.obj("kopf.dev/v1/kopfpeerings", namespace, RELEASE) or {}
    return dict(peering.get("status") or {})


def _leader(api: ControlPlane, namespace: str) -> str | None:
    peers = _peers(api, namespace)
    if len(peers) < 2:
        return None
    return max(peers, key=lambda pid: (peers[pid].get("priority", 0), pid))


def test_a_namespaced_release_with_two_replicas_fails_over(tmp_path: pathlib.Path) -> None:
    team = "team-a"
    with ControlPlane(tmp_path / "api", scheduler=False) as api:
        api.apply_crds(PEERING_CRDS)
        api.request("POST", "/api/v1/namespaces", {"metadata": {"name": team}}, expect=201)
        values = ["--set", f"watchNamespaces={{{team}}}", "--set", "replicaCount=2"]
        run_helm(api, "install", RELEASE, str(CHART), "-n", SYSTEM, "--create-namespace", *values)
        argv = deployment_argv(api, SYSTEM, RELEASE)
        assert f"--namespace={team}" in argv and "--require-peering" in argv, argv
        logs = {pid: tmp_path / f"operator-{pid}.log" for pid in ("replica-a", "replica-b")}
        with contextlib.ExitStack() as stack:
            procs = {
                pid: stack.enter_context(operator(api, argv, log, pid)) for pid, log in logs.items()
            }
            leader = wait_until(lambda: _leader(api, team), 120, 0.5, "both replicas to peer")
            api.kubectl("apply", "-n", team, "-f", str(EXAMPLE))
            wait_until(lambda: not children_missing(api, team), 120, 0.5, "every child")
            procs[leader].send_signal(signal.SIGKILL)
            procs[leader].wait(10)
            killed = time.monotonic()
            api.kubectl("scale", "-n", team, "ie/smollm2", "--replicas=3")
            wait_until(
                lambda: api.obj("v1/pods", team, "smollm2-engine-2"),
                240,
                0.5,
                "the other replica to take over and create rank 2",
            )
            print(
                f"leader failover: rank 2 created {time.monotonic() - killed:.1f} s after the kill"
            )
        for log in logs.values():
            assert_no_403(log)


def test_helm_does_not_adopt_a_crd_applied_with_kubectl(tmp_path: pathlib.Path) -> None:
    # The README says so where a reader runs both: the chart installs the CRD unless
    # crds.install=false, and Helm refuses a resource it did not create.
    readme = README.read_text()
    assert "crds.install=false" in readme[: readme.index("helm install corefleet")], (
        "the README must warn before its helm install command"
    )
    with ControlPlane(tmp_path / "api", controller_manager=False, scheduler=False) as api:
        api.apply_crds(REPO / "crds" / "inferenceengines.corefleet.dev.yaml")
        refused = run_helm(
            api, "install", RELEASE, str(CHART), "-n", SYSTEM, "--create-namespace", check=False
        )
        assert refused.returncode != 0
        assert "inferenceengines.corefleet.dev" in refused.stderr, refused.stderr
        assert "ownership metadata" in refused.stderr, refused.stderr
        run_helm(api, "uninstall", RELEASE, "-n", SYSTEM, check=False)
        run_helm(
            api,
            "install",
            RELEASE,
            str(CHART),
            "-n",
            SYSTEM,
            "--create-namespace",
            "--set",
            "crds.install=false",
        )
