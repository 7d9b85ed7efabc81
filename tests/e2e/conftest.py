"""End-to-end tests on the local cluster harness: the emulated API server driven by kubectl.

tests/e2e is not a package: pytest puts this folder on sys.path (`from apiserver import
ApiServer`), and this file adds tests/integration/operator, where the emulator lives (`kubeemu`,
`kubeemu_server`). Every test here is skipped, with the reason, where kubectl is not installed.

Fixtures:
- `api_server` -> `apiserver.ApiServer`, function-scoped and already entered: a fresh emulator
  on 127.0.0.1 with the InferenceEngine CRD, the `default` namespace and kubelet-finalised pod
  deletion; its kubeconfig is `tmp_path / "apiserver" / "kubeconfig"`. Stopped after the test.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "integration" / "operator"))

from apiserver import KUBECTL, ApiServer  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip this folder's tests when kubectl is missing."""
    if KUBECTL is not None:
        return
    skip = pytest.mark.skip(
        reason="kubectl is not installed: the e2e harness drives the emulated cluster with it"
    )
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(skip)


@pytest.fixture
def api_server(tmp_path: Path) -> Iterator[ApiServer]:
    """A fresh ApiServer for one test (see the module docstring)."""
    with ApiServer(tmp_path / "apiserver") as server:
        yield server
