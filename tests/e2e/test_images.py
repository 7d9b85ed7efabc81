"""The images `make images` builds, run as a cluster would run them.

- the engine image serves the README's chat request on its embedded model, as its non-root user
  (10001) with a read-only root filesystem (only tmpfs at /tmp and /var/cache/corefleet);
- its coordinator command starts and serves its HTTP API with no rank;
- the operator image starts, reads its kubeconfig (the chart's ServiceAccount against the real
  control plane) and reconciles an InferenceEngine into its children.
Containers bind 127.0.0.1 on free ports and are removed by the test that started them.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence

import openai
import pytest
from control_plane import ControlPlane
from docker_images import DOCKER
from e2e_support import REPO, wait_until
from images_support import ENGINE_IMAGE, OPERATOR_IMAGE, require_images
from operator_identity import install_chart, operator_kubeconfig
from processes import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
MODEL = "SmolLM2-135M-Instruct"
START_TIMEOUT = 300.0  # a cold page cache and a busy 2-core machine


def _docker(*args: str, check: bool = True, timeout: float = 120) -> str:
    done = subprocess.run([DOCKER, *args], capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"docker {args[0]}: {done.stderr.strip()}")
    return done.stdout


@contextlib.contextmanager
def container(
    name: str, docker_args: Sequence[str], image: str, args: Sequence[str]
) -> Iterator[str]:
    """A detached container, removed on exit; its log is in the failure message."""
    require_images()
    _docker("rm", "-f", name, check=False)
    _docker("run", "-d", "--name", name, *docker_args, image, *args)
    try:
        yield name
    except BaseException as exc:
        log = subprocess.run([DOCKER, "logs", "--tail", "60", name], capture_output=True, text=True)
        raise AssertionError(f"{exc}\n--- {name}\n{log.stdout}{log.stderr}") from exc
    finally:
        _docker("rm", "-f", name, check=False)


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def _read_only_non_root(name: str) -> None:
    assert _docker("exec", name, "id", "-u").strip() == "10001"
    done = subprocess.run(
        [DOCKER, "exec", name, "touch", "/opt/venv/probe"], capture_output=True, text=True
    )
    assert done.returncode != 0 and "Read-only file system" in done.stderr, done.stderr


def test_engine_image_serves_the_readme_chat_as_non_root_on_a_read_only_root() -> None:
    port = free_port()
    docker_args = [
        "--read-only", "--tmpfs", "/tmp", "--tmpfs", "/var/cache/corefleet",
        "--shm-size", "256m", "-p", f"127.0.0.1:{port}:8000",
    ]  # fmt: skip
    with container(f"cf-test-serve-{os.getpid()}", docker_args, ENGINE_IMAGE,
                   ["serve", "--host", "0.0.0.0", "--port", "8000"]) as name:  # fmt: skip
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: _status(f"{base}/ready") == 200, START_TIMEOUT, 1.0, "a ready rank")
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == [MODEL]
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Name three planets."}],
            max_tokens=64,
            temperature=0.0,
        )
        assert reply.choices[0].message.content, reply
        assert reply.usage is not None and reply.usage.completion_tokens > 0
        _read_only_non_root(name)


def test_coordinator_command_starts_from_the_engine_image() -> None:
    port = free_port()
    docker_args = ["--read-only", "--tmpfs", "/tmp", "-p", f"127.0.0.1:{port}:8000"]
    args = [
        "coordinator", "--model", "/opt/corefleet/models/SmolLM2-135M-Instruct.Q4_1.gguf",
        "--served-model-name", MODEL, "--advertise-host", "127.0.0.1",
    ]  # fmt: skip
    with container(f"cf-test-coordinator-{os.getpid()}", docker_args, ENGINE_IMAGE, args) as name:
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: _status(f"{base}/health") == 200, START_TIMEOUT, 1.0, "/health")
        assert _status(f"{base}/ready") == 503  # no rank has joined
        _read_only_non_root(name)


def test_operator_image_reconciles_an_engine(
    api_server: ControlPlane, tmp_path: pathlib.Path
) -> None:
    install_chart(api_server)
    config, _ = operator_kubeconfig(api_server, tmp_path / "kubeconfig")
    # The image's user (10001) reads them; the kubeconfig names the CA by this machine's path,
    # mounted at the same path inside.
    shared = tmp_path / "mounted"
    shared.mkdir()
    shutil.copy(config, shared / "kubeconfig")
    (shared / "kubeconfig").chmod(0o644)
    ca = str(api_server.pki.ca)
    health = free_port()
    docker_args = [
        "--network", "host", "--read-only", "--tmpfs", "/tmp",
        "-v", f"{shared / 'kubeconfig'}:/etc/corefleet/kubeconfig:ro", "-v", f"{ca}:{ca}:ro",
        "-e", "KUBECONFIG=/etc/corefleet/kubeconfig", "-e", "COREFLEET_OPERATOR_ADMIN_PROBE=0",
    ]  # fmt: skip
    args = ["--standalone", "--all-namespaces", f"--liveness=http://127.0.0.1:{health}/healthz"]
    with container(f"cf-test-operator-{os.getpid()}", docker_args, OPERATOR_IMAGE, args):
        api_server.kubectl("apply", "-f", str(REPO / "examples" / "smollm2-cpu.yaml"))

        def children() -> bool:
            pods = {p["metadata"]["name"] for p in api_server.objs("v1/pods", "default")}
            coordinator = api_server.obj("apps/v1/deployments", "default", "smollm2-coordinator")
            return {"smollm2-engine-0", "smollm2-engine-1"} <= pods and coordinator is not None

        wait_until(children, 120, 0.5, "the operator to create the ranks and the coordinator")
        engine = json.loads(api_server.kubectl("get", "ie", "smollm2", "-o", "json").stdout)
        assert engine.get("status", {}).get("observedGeneration") == 1, engine.get("status")
        assert _status(f"http://127.0.0.1:{health}/healthz") == 200
