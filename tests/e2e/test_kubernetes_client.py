"""The official `kubernetes` Python client against a real kube-apiserver, through the admin
kubeconfig (TLS, client certificate): what a user's script or another controller would do with an
InferenceEngine."""

from __future__ import annotations

import pathlib
import threading

import pytest
import yaml
from control_plane import ControlPlane

kubernetes = pytest.importorskip("kubernetes")
pytestmark = pytest.mark.e2e

GROUP, VERSION, PLURAL = "corefleet.dev", "v1alpha1", "inferenceengines"
EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "smollm2-cpu.yaml"


def _client(server: ControlPlane) -> kubernetes.client.ApiClient:
    return kubernetes.config.new_client_from_config(config_file=str(server.kubeconfig))


def test_custom_objects_create_get_scale_and_patch_status(api_server: ControlPlane) -> None:
    api = kubernetes.client.CustomObjectsApi(_client(api_server))
    body = yaml.safe_load(EXAMPLE.read_text())
    created = api.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, body)
    assert created["metadata"]["uid"] and created["spec"]["dataParallelSize"] == 2
    api.patch_namespaced_custom_object_scale(
        GROUP, VERSION, "default", PLURAL, "smollm2", {"spec": {"replicas": 3}}
    )
    got = api.get_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "smollm2")
    assert got["spec"]["dataParallelSize"] == 3
    api.patch_namespaced_custom_object_status(
        GROUP, VERSION, "default", PLURAL, "smollm2", {"status": {"rankSummary": "3/3"}}
    )
    printed = api_server.kubectl("get", "ie", "smollm2").stdout
    assert "3/3" in printed, printed
    with pytest.raises(kubernetes.client.ApiException) as missing:
        api.get_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "nope")
    assert missing.value.status == 404


def test_core_api_lists_and_watches_pods(api_server: ControlPlane) -> None:
    core = kubernetes.client.CoreV1Api(_client(api_server))
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "labels": {"app": "x"}},
        "spec": {"containers": [{"name": "c", "image": "corefleet:dev"}]},
    }
    seen: list[str] = []

    def watch() -> None:
        stream = kubernetes.watch.Watch().stream(
            core.list_namespaced_pod, "default", label_selector="app=x", timeout_seconds=120
        )
        for event in stream:
            seen.append(f"{event['type']} {event['object'].metadata.name}")
            if len(seen) == 1:
                break

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    core.create_namespaced_pod("default", pod)
    watcher.join(150)
    assert seen == ["ADDED p"]
    names = [
        p.metadata.name for p in core.list_namespaced_pod("default", label_selector="app=x").items
    ]
    assert names == ["p"]
    assert core.list_namespaced_pod("default", label_selector="app=y").items == []
