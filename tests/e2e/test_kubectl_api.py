"""The real kubectl against the emulated API server: the InferenceEngine workflow a user runs.

No operator and no kubelet run here: the test plays them (status PATCHes, finalizer removal,
the kubelet's final pod DELETE), so these tests take seconds. What is asserted is what kubectl
prints and what the server stores. Pods, Deployments and graceful deletion are in
test_kubectl_pods.py; refused requests in test_kubectl_errors.py.
"""

from __future__ import annotations

import contextlib
import json
import queue
import re
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from apiserver import CRD_FILE, KUBECTL, MERGE, REPO, ApiServer, parse_table, wait_until
from kubeemu_table import age, custom_cell, human_duration, json_path

pytestmark = pytest.mark.e2e
EXAMPLE = REPO / "examples" / "smollm2-cpu.yaml"
IE = "corefleet.dev/v1alpha1/inferenceengines"
IE_URL = "/apis/corefleet.dev/v1alpha1/namespaces/default/inferenceengines"
TABLE = "application/json;as=Table;v=v1;g=meta.k8s.io,application/json"
READY_STATUS = {
    "rankSummary": "2/2",
    "endpoint": "http://smollm2-coordinator.default.svc:8000",
    "conditions": [
        {"type": "Degraded", "status": "False", "reason": "AllRanksReady"},
        {"type": "Ready", "status": "True", "reason": "AllRanksReady"},
    ],
}


def engine(api: ApiServer) -> dict[str, Any]:
    """The stored smollm2 InferenceEngine."""
    obj = api.emu.obj(IE, "default", "smollm2")
    assert obj is not None, "smollm2 does not exist"
    return obj


def test_apply_then_get_ie_prints_the_printer_columns(api_server: ApiServer) -> None:
    out = api_server.kubectl("apply", "-f", str(EXAMPLE)).stdout
    assert out.strip() == "inferenceengine.corefleet.dev/smollm2 created"
    [row] = parse_table(api_server.kubectl("get", "ie").stdout)
    assert list(row) == ["NAME", "RANKS", "READY", "ENDPOINT", "AGE"]
    assert row["NAME"] == "smollm2" and row["RANKS"] == row["READY"] == row["ENDPOINT"] == ""
    assert row["AGE"] in ("0s", "1s", "2s")

    api_server.patch_status(IE, "default", "smollm2", READY_STATUS)
    [row] = parse_table(api_server.kubectl("get", "ie").stdout)
    assert (row["RANKS"], row["READY"], row["ENDPOINT"]) == (
        "2/2",
        "True",
        "http://smollm2-coordinator.default.svc:8000",
    )
    [row] = parse_table(api_server.kubectl("get", "inferenceengine", "smollm2").stdout)
    assert row["RANKS"] == "2/2"
    jsonpath = "-o=jsonpath={.status.rankSummary} {.spec.dataParallelSize}"
    assert api_server.kubectl("get", "ie", "smollm2", jsonpath).stdout == "2/2 2"
    waited = api_server.kubectl("wait", "--for=condition=Ready", "ie/smollm2", "--timeout=10s")
    assert "condition met" in waited.stdout


def test_the_table_is_what_the_apiextensions_server_answers(api_server: ApiServer) -> None:
    api_server.kubectl("apply", "-f", str(EXAMPLE))
    api_server.patch_status(IE, "default", "smollm2", READY_STATUS)
    _, table = api_server.request("GET", IE_URL, headers={"Accept": TABLE}, expect=200)
    assert (table["apiVersion"], table["kind"]) == ("meta.k8s.io/v1", "Table")
    columns = [
        (c["name"], c["type"], c["format"]) for c in table["columnDefinitions"] if not c["priority"]
    ]
    assert columns == [
        ("Name", "string", "name"),
        ("Ranks", "string", ""),
        ("Ready", "string", ""),
        ("Endpoint", "string", ""),
        ("Age", "date", ""),
    ]  # the priority-1 columns follow: kubectl shows them with -o wide (test_kubectl_explain.py)
    assert table["columnDefinitions"][1]["description"] == "Ready ranks / desired ranks"
    [row] = table["rows"]
    assert row["cells"][:4] == ["smollm2", "2/2", "True", READY_STATUS["endpoint"]]
    assert row["object"]["kind"] == "PartialObjectMetadata"
    assert row["object"]["metadata"]["uid"] == engine(api_server)["metadata"]["uid"]
    url = f"{IE_URL}/smollm2?includeObject=Object"
    _, single = api_server.request("GET", url, headers={"Accept": TABLE}, expect=200)
    assert single["rows"][0]["object"]["spec"]["dataParallelSize"] == 2
    _, plain = api_server.request("GET", f"{IE_URL}/smollm2", expect=200)
    assert plain["kind"] == "InferenceEngine"


def test_ages_read_as_kubernetes_prints_them() -> None:
    expected = {0: "0s", 5: "5s", 119: "119s", 125: "2m5s", 180: "3m", 600: "10m", 10799: "179m"}
    expected |= {3 * 3600 + 240: "3h4m", 9 * 3600: "9h", 50 * 3600: "2d2h", 30 * 86400: "30d"}
    expected |= {800 * 86400: "2y70d", 10 * 365 * 86400: "10y"}
    assert {s: human_duration(s) for s in expected} == expected
    assert re.fullmatch(r"\d+y(\d+d)?", age("2020-01-01T00:00:00Z"))
    assert age(None) == "<unknown>"


def test_printer_columns_evaluate_like_the_apiextensions_server() -> None:
    obj = {
        "spec": {"n": 2.0, "on": True, "tags": ["a", "b"], "m": {"k": "v"}},
        "status": {"conditions": [{"type": "A", "status": "False"}, {"type": "B", "ok": 1}]},
    }
    assert json_path(obj, '.status.conditions[?(@.type=="B")].ok') == [1]
    assert json_path(obj, "{.status.conditions[*].type}") == ["A", "B"]
    assert json_path(obj, ".spec.tags[1]") == ["b"] and json_path(obj, ".spec.nope") == []

    def cell(kind: str, path: str) -> Any:
        return custom_cell({"name": "X", "type": kind, "jsonPath": path}, obj)

    assert cell("integer", ".spec.n") == 2 and cell("number", ".spec.n") == 2.0
    assert cell("boolean", ".spec.on") is True and cell("string", ".spec.on") == "true"
    assert cell("string", ".spec.m") == '{"k":"v"}' and cell("string", ".spec.nope") is None
    assert cell("integer", ".spec.on") is None  # the wrong JSON type prints nothing
    assert cell("date", ".spec.m.k") == "<invalid>"
    assert cell("string", '.status.conditions[?(@.type=="A")].status') == "False"


def test_reapplying_a_changed_file_patches_the_spec(api_server: ApiServer, tmp_path: Path) -> None:
    api_server.kubectl("apply", "-f", str(EXAMPLE))
    manifest = yaml.safe_load(EXAMPLE.read_text())
    manifest["spec"]["engine"]["maxNumSeqs"] = 16
    del manifest["spec"]["nodeSelector"]  # in the last applied configuration, so it goes
    changed = tmp_path / "smollm2.yaml"
    changed.write_text(yaml.safe_dump(manifest))

    out = api_server.kubectl("apply", "-f", str(changed)).stdout
    assert out.strip() == "inferenceengine.corefleet.dev/smollm2 configured"
    spec, meta = engine(api_server)["spec"], engine(api_server)["metadata"]
    assert (spec["engine"]["maxNumSeqs"], spec["engine"]["maxNumBatchedTokens"]) == (16, 2048)
    assert spec["engine"]["blockSize"] == 16  # the CRD's default stays filled in
    assert "nodeSelector" not in spec and spec["dataParallelSize"] == 2
    assert meta["generation"] == 2
    applied = json.loads(meta["annotations"]["kubectl.kubernetes.io/last-applied-configuration"])
    assert applied["spec"] == manifest["spec"]
    out = api_server.kubectl("apply", "-f", str(changed)).stdout
    assert out.strip() == "inferenceengine.corefleet.dev/smollm2 unchanged"

    patch = json.dumps({"spec": {"engine": {"maxNumSeqs": 8}}})
    out = api_server.kubectl("patch", "ie", "smollm2", "--type", "merge", "-p", patch).stdout
    assert out.strip() == "inferenceengine.corefleet.dev/smollm2 patched"
    spec = engine(api_server)["spec"]
    assert (spec["engine"]["maxNumSeqs"], spec["engine"]["maxNumBatchedTokens"]) == (8, 2048)
    assert engine(api_server)["metadata"]["generation"] == 3


def test_scale_writes_data_parallel_size(api_server: ApiServer) -> None:
    crd = yaml.safe_load(CRD_FILE.read_text())
    scale = crd["spec"]["versions"][0]["subresources"]["scale"]
    assert scale["specReplicasPath"] == ".spec.dataParallelSize"
    api_server.kubectl("apply", "-f", str(EXAMPLE))
    api_server.patch_status(IE, "default", "smollm2", {"replicas": 2, "selector": "a=b"})

    out = api_server.kubectl("scale", "ie/smollm2", "--replicas=1").stdout
    assert out.strip() == "inferenceengine.corefleet.dev/smollm2 scaled"
    assert engine(api_server)["spec"]["dataParallelSize"] == 1
    assert engine(api_server)["metadata"]["generation"] == 2
    jsonpath = "-o=jsonpath={.spec.dataParallelSize}"
    assert api_server.kubectl("get", "ie", "smollm2", jsonpath).stdout == "1"
    raw = api_server.kubectl("get", "--raw", f"{IE_URL}/smollm2/scale").stdout
    assert json.loads(raw) | {"metadata": None} == {
        "apiVersion": "autoscaling/v1",
        "kind": "Scale",
        "metadata": None,
        "spec": {"replicas": 1},
        "status": {"replicas": 2, "selector": "a=b"},
    }
    api_server.kubectl("scale", "ie", "smollm2", "--replicas=2", "--current-replicas=1")
    assert engine(api_server)["spec"]["dataParallelSize"] == 2


def _play_operator_gc_and_kubelet(api: ApiServer, stop: threading.Event, seen: list[Any]) -> None:
    """Until `stop`: remove the engine's finalizer once it is terminating (the operator, after
    a delay kubectl must wait through) and finish terminating pods (the kubelet); `seen` gets
    "engine", then (pod name, its deletionGracePeriodSeconds) for each pod finished."""
    done: set[str] = set()
    while not stop.is_set():
        obj = api.emu.obj(IE, "default", "smollm2")
        if obj and obj["metadata"].get("deletionTimestamp") and "engine" not in seen:
            seen.append("engine")
            time.sleep(0.5)
            body = {"metadata": {"finalizers": None}}
            api.request("PATCH", f"{IE_URL}/smollm2", body, content_type=MERGE, expect=200)
        for pod in api.emu.objs("v1/pods", "default"):
            meta = pod["metadata"]
            if meta.get("deletionTimestamp") and meta["name"] not in done:
                done.add(meta["name"])
                seen.append((meta["name"], meta["deletionGracePeriodSeconds"]))
                body = {"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}}
                url = f"/api/v1/namespaces/default/pods/{meta['name']}"
                api.request("DELETE", url, body, expect=200)
        time.sleep(0.05)


def test_kubectl_delete_waits_while_operator_gc_and_kubelet_finish(api_server: ApiServer) -> None:
    api_server.kubectl("apply", "-f", str(EXAMPLE))
    finalizer = json.dumps({"metadata": {"finalizers": ["corefleet.dev/cleanup"]}})
    api_server.kubectl("patch", "ie", "smollm2", "--type", "merge", "-p", finalizer)
    owner = {
        "apiVersion": "corefleet.dev/v1alpha1",
        "kind": "InferenceEngine",
        "name": "smollm2",
        "uid": engine(api_server)["metadata"]["uid"],
    }
    for rank in (0, 1):
        pod = {
            "metadata": {"name": f"smollm2-engine-{rank}", "ownerReferences": [owner]},
            "spec": {"nodeName": "node-1", "containers": [{"name": "engine", "image": "x"}]},
        }
        pod["spec"]["terminationGracePeriodSeconds"] = 30
        api_server.request("POST", "/api/v1/namespaces/default/pods", pod, expect=201)

    stop, seen = threading.Event(), list[Any]()
    player = threading.Thread(target=_play_operator_gc_and_kubelet, args=(api_server, stop, seen))
    player.start()
    try:
        started = time.monotonic()
        out = api_server.kubectl("delete", "ie", "smollm2", timeout=30).stdout
        waited = time.monotonic() - started
        assert out.strip() == 'inferenceengine.corefleet.dev "smollm2" deleted'
        assert api_server.emu.obj(IE, "default", "smollm2") is None
        assert waited >= 0.5, "kubectl delete returned before the finalizer was removed"
        wait_until(lambda: not api_server.emu.objs("v1/pods"), 10, what="pods gone")
        # garbage collection deleted the pods gracefully: with their own grace period
        assert seen == ["engine", ("smollm2-engine-0", 30), ("smollm2-engine-1", 30)]
    finally:
        stop.set()
        player.join(10)


def test_delete_with_wait_false_returns_while_the_finalizer_holds(api_server: ApiServer) -> None:
    api_server.kubectl("apply", "-f", str(EXAMPLE))
    finalizer = json.dumps({"metadata": {"finalizers": ["corefleet.dev/cleanup"]}})
    api_server.kubectl("patch", "ie", "smollm2", "--type", "merge", "-p", finalizer)
    out = api_server.kubectl("delete", "-f", str(EXAMPLE), "--wait=false", timeout=10).stdout
    assert out.strip() == 'inferenceengine.corefleet.dev "smollm2" deleted'
    meta = engine(api_server)["metadata"]
    assert meta["deletionTimestamp"] and meta["deletionGracePeriodSeconds"] == 0
    assert parse_table(api_server.kubectl("get", "ie").stdout)[0]["NAME"] == "smollm2"
    remove = json.dumps([{"op": "remove", "path": "/metadata/finalizers"}])
    api_server.kubectl("patch", "ie", "smollm2", "--type", "json", "-p", remove)
    assert api_server.emu.obj(IE, "default", "smollm2") is None
    assert "No resources found" in api_server.kubectl("get", "ie").stderr


def _lines(stream: Any, into: queue.Queue[str]) -> None:
    for line in stream:
        into.put(line)


def test_get_watch_prints_rows_as_the_engine_changes(api_server: ApiServer) -> None:
    api_server.kubectl("apply", "-f", str(EXAMPLE))
    assert KUBECTL is not None
    cmd = [KUBECTL, f"--cache-dir={api_server.folder / 'kube-cache'}", "get", "ie", "-w"]
    watcher = subprocess.Popen(cmd, env=api_server.env(), stdout=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_lines, args=(watcher.stdout, lines), daemon=True).start()
    try:
        assert lines.get(timeout=10).split() == ["NAME", "RANKS", "READY", "ENDPOINT", "AGE"]
        assert lines.get(timeout=10).split()[0] == "smollm2"
        api_server.patch_status(IE, "default", "smollm2", READY_STATUS)
        row = ["smollm2", "2/2", "True", READY_STATUS["endpoint"]]
        assert lines.get(timeout=10).split()[:4] == row
    finally:
        watcher.kill()
        watcher.wait(10)


def test_stopping_the_server_ends_open_watches(tmp_path: Path) -> None:
    ended = threading.Event()

    def watch(url: str) -> None:
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=30) as answer:
            answer.read()
        ended.set()

    with ApiServer(tmp_path) as api:
        url = f"{api.url}/api/v1/namespaces/default/pods?watch=1"
        threading.Thread(target=watch, args=(url,), daemon=True).start()
        wait_until(lambda: api.emu._events._watchers.get("v1/pods"), 5, what="the watch")
        stopping = time.monotonic()
    assert time.monotonic() - stopping < 10  # the watch ended: the thread join did not time out
    assert ended.wait(5)
