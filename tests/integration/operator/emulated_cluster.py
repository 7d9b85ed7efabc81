"""The emulator as a scenario's API server: only for faults a real server will not make on demand.

`emulated_cluster()` serves a `KubeEmu` (kubeemu.py) with the InferenceEngine CRD registered and a
`default` namespace, and points KUBECONFIG at it. Its reactions (kmock's DSL on `cluster.emu`)
answer chosen requests with a 409, 410, 429 or 5xx, hold a request, or end every watch, and its
request log shows every request the operator sent, refused ones included. Every other scenario
runs against the real control plane (`real_cluster.py`); `test_kubeemu_differential.py` keeps
the emulator's answers equal to the real server's.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import yaml
from kubeemu import KubeEmu
from kubeemu_model import labels_match
from kubeemu_server import ServedInThread
from operator_harness import CRD, Cluster


class EmulatedCluster(Cluster):
    """The emulator (`emu`) plus the harness's HTTP helpers."""

    def __init__(self, emu: KubeEmu, url: str, session: aiohttp.ClientSession) -> None:
        self.emu, self.url, self.session = emu, url, session

    def obj(self, path: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.emu.obj(path, namespace, name)

    def objs(self, path: str, namespace: str | None = None, selector: str = "") -> list[Any]:
        return [
            o
            for o in self.emu.objs(path, namespace)
            if labels_match(o["metadata"].get("labels") or {}, selector)
        ]


def write_kubeconfig(path: pathlib.Path, url: str, token: str = "test") -> pathlib.Path:
    """A kubeconfig for the emulator (any token is accepted; it shows in the request log)."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "emu",
        "clusters": [{"name": "emu", "cluster": {"server": url}}],
        "users": [{"name": "emu", "user": {"token": token}}],
        "contexts": [
            {"name": "emu", "context": {"cluster": "emu", "user": "emu", "namespace": "default"}}
        ],
    }
    path.write_text(yaml.safe_dump(config))
    return path


@contextlib.asynccontextmanager
async def emulated_cluster(
    kubeconfig: pathlib.Path, **emu_options: Any
) -> AsyncIterator[EmulatedCluster]:
    """Serve an emulator with the CRD and a `default` namespace; KUBECONFIG points at it."""
    emu = KubeEmu(**emu_options)
    emu.register_crd(CRD)
    with ServedInThread(emu) as url:
        os.environ["KUBECONFIG"] = str(write_kubeconfig(kubeconfig, url))
        async with aiohttp.ClientSession() as session:
            harness = EmulatedCluster(emu, url, session)
            await harness.request("POST", "/api/v1/namespaces", {"metadata": {"name": "default"}})
            yield harness
