"""End-to-end tests against a real Kubernetes control plane, driven by the real kubectl.

tests/e2e is not a package: pytest puts this folder on sys.path (`from cluster import
LocalCluster`), and this file adds tests/controlplane (the real control plane: `ControlPlane`)
and tests/integration/operator (the emulator, kept for the faults a real server will not make on
demand). Every test here is skipped, with the reason, where kubectl is not installed or the
control plane has not been built (`make cluster-bin`); `make test` builds it and sets
COREFLEET_REQUIRE_CONTROLPLANE=1, which turns that skip into a failure.

Fixtures:
- `api_server` -> `control_plane.ControlPlane`, function-scoped and already entered: a fresh
  etcd, kube-apiserver, controller manager and scheduler on 127.0.0.1 with the InferenceEngine
  CRD applied and Established (before the controller manager started); its admin kubeconfig
  is `api_server.kubeconfig`. Stopped after the test. No node: pods stay Pending unless a test
  starts a `LocalCluster`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "integration" / "operator"))
sys.path.insert(0, str(HERE.parent / "controlplane"))

from admin_client import KUBECTL  # noqa: E402
from control_plane import ControlPlane, binaries  # noqa: E402

REPO = HERE.parents[1]
CRD_FILE = REPO / "crds" / "inferenceengines.corefleet.dev.yaml"


def _why_not() -> str | None:
    if KUBECTL is None:
        return "kubectl is not installed: the e2e tests drive the cluster with it"
    found = binaries()
    return found if isinstance(found, str) else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip this folder's tests without kubectl or a control plane (fail when one is required)."""
    reason = _why_not()
    if reason is None:
        return
    if os.environ.get("COREFLEET_REQUIRE_CONTROLPLANE") == "1":
        raise pytest.UsageError(f"COREFLEET_REQUIRE_CONTROLPLANE=1, but {reason}")
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def module_api_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """One control plane with the InferenceEngine CRD for a module whose tests leave nothing
    the next one would see (they read, or are refused)."""
    with ControlPlane(tmp_path_factory.mktemp("control-plane"), crds=[CRD_FILE]) as api:
        yield api


@pytest.fixture
def api_server(tmp_path: Path) -> Iterator[ControlPlane]:
    """A fresh control plane with the InferenceEngine CRD (see the module docstring)."""
    with ControlPlane(tmp_path / "control-plane", crds=[CRD_FILE]) as api:
        yield api
