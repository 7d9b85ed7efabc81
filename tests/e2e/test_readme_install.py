"""The README's operator install, run as written on a fresh API server (issue 18's "Show").

Every command of the README's first block under "On Kubernetes: the operator" runs in order
against a fresh real control plane (kube-apiserver serves a custom kind only once its CRD is
established, so an install that applies objects before their kinds are served fails), as the
cluster's admin, as a reader would. Then the README's example is applied and the operator,
started by the README's own command line, must create its rank pods and join its peering.
"""

from __future__ import annotations

import pathlib
import re
import shlex
import signal
import subprocess
import sys
import time

from control_plane import REPO, ControlPlane
from e2e_support import wait_until

README = REPO / "README.md"
SECTION = "## On Kubernetes: the operator"
EXAMPLE = "examples/smollm2-cpu.yaml"


def install_commands() -> list[list[str]]:
    """The first ```bash block of the README's operator section, a word list per command."""
    text = README.read_text()
    section = text[text.index(SECTION) :]
    block = re.search(r"```bash\n(.*?)```", section, re.DOTALL)
    assert block is not None, "no bash block in the README's operator section"
    commands = []
    for line in block.group(1).splitlines():
        words = shlex.split(line, comments=True)
        if words:
            commands.append([_absolute(word) for word in words])
    return commands


def _absolute(word: str) -> str:
    # The README runs from the repository's root; the test may run anywhere.
    path = REPO / word
    return str(path) if not word.startswith("-") and path.exists() else word


def _run_kubectl(api: ControlPlane, args: list[str]) -> None:
    """One README kubectl command; `kubectl wait` again, as a reader would, when it read a CRD
    before the server gave it any condition (a kubectl bug, kubernetes/kubernetes#66439:
    ".status.conditions accessor error: <nil> is of the type <nil>")."""
    for _ in range(10):
        done = api.kubectl(*args, timeout=60, check=False)
        if done.returncode == 0:
            return
        if args[0] != "wait" or "accessor error" not in done.stderr:
            break
        time.sleep(0.5)
    raise AssertionError(f"kubectl {' '.join(args)}: {done.stderr}")


def _start_operator(
    api: ControlPlane, argv: list[str], log: pathlib.Path
) -> subprocess.Popen[bytes]:
    command = str(pathlib.Path(sys.executable).parent / argv[0])
    # The liveness endpoint stays off: a test must not take the node's port 8080.
    with open(log, "ab") as out:
        return subprocess.Popen(
            [command, *argv[1:], "--liveness", ""],
            env=api.env(),
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def test_the_readme_install_applies_in_one_go_on_a_fresh_server(tmp_path: pathlib.Path) -> None:
    commands = install_commands()
    assert [c[0] for c in commands][-1] == "corefleet-operator", commands
    log = tmp_path / "operator.log"
    operator: subprocess.Popen[bytes] | None = None
    with ControlPlane(tmp_path / "api", scheduler=False) as api:
        try:
            for argv in commands:
                if argv[0] == "kubectl":
                    _run_kubectl(api, argv[1:])
                else:
                    operator = _start_operator(api, argv, log)
            api.kubectl("apply", "-f", str(REPO / EXAMPLE))
            wait_until(
                lambda: api.obj("v1/pods", "default", "smollm2-engine-0"),
                120,
                what="the operator to create rank 0's pod",
            )
            peering = api.obj("kopf.dev/v1/clusterkopfpeerings", "", "corefleet-operator")
            assert peering is not None and (peering.get("status") or {}), peering
        finally:
            if operator is not None:
                operator.send_signal(signal.SIGTERM)
                operator.wait(30)
    output = log.read_text(errors="replace")
    assert "standalone" not in output.lower(), output[-3000:]
