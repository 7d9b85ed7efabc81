"""Operator integration tests: kopf's settings for a fast, deterministic run, and the imports.

The operator reads these once (the timer interval when `corefleet.operator.main` is imported),
so they are set before any test imports it. The coordinator's /admin/engines is not probed: no
coordinator runs here (tests/unit/operator/test_operator_admin.py covers that client).

This folder is not a package: pytest puts it on sys.path, and this file adds tests/controlplane
(the real control plane, `ControlPlane`), whose modules import each other as top-level modules.
A scenario that needs the control plane skips, with the reason, where it has not been built
(`make cluster-bin`) or helm is missing; COREFLEET_REQUIRE_CONTROLPLANE=1 (`make test`) turns
that skip into a failure (`real_cluster.real_cluster`).
"""

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("COREFLEET_OPERATOR_TIMER_SECONDS", "1")
os.environ.setdefault("COREFLEET_OPERATOR_ADMIN_PROBE", "0")
os.environ.setdefault("COREFLEET_OPERATOR_FAILED_BACKOFF_SECONDS", "1")

CONTROLPLANE = str(Path(__file__).resolve().parents[2] / "controlplane")
if CONTROLPLANE not in sys.path:
    sys.path.insert(0, CONTROLPLANE)


@pytest.fixture(scope="session")
def differential_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Any]]:
    """The emulator's URL and a real control plane, for test_kubeemu_differential*.py."""
    from control_plane import binaries
    from differential import both_servers

    found = binaries()
    if isinstance(found, str):
        if os.environ.get("COREFLEET_REQUIRE_CONTROLPLANE") == "1":
            pytest.fail(f"COREFLEET_REQUIRE_CONTROLPLANE=1, but {found}")
        pytest.skip(found)
    with both_servers(tmp_path_factory.mktemp("differential")) as servers:
        yield servers
