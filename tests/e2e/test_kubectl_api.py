"""The real kubectl against a real kube-apiserver: the InferenceEngine workflow a user runs.

No operator and no kubelet run here: the test plays them (status PATCHes, finalizer removal,
the kubelet's final pod DELETE), while the real controller manager's garbage collector deletes
the engine's pods once the engine is gone. What is asserted is what kubectl prints and what the
server stores for our CRD. Pods, Deployments and graceful deletion are in test_kubectl_pods.py;
refused requests in test_kubectl_errors.py.
"""

from __future__ import annotations

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
from admin_client import KUBECTL, MERGE
from control_plane import ControlPlane
from e2e_support import CRD_FILE, REPO, parse_table, wait_until

pytestmark = pytest.mark.e2e
EXAMPLE = REPO / "examples" / "smollm2-cpu.yaml"
IE = "corefleet.dev/v1alpha1/inferenceengines"
IE_URL = "/apis/corefleet.dev/v1alpha1/namespaces/default/inferenceengines"
TABLE = "application/json;as=Table;v=v1;g=meta.k8s.io,application/json"
READY_STATUS = {
    "rankSummary": "2/2",
    "endpoint": "http://smollm2-coordinator.default.svc:8000",
    "conditions": [
        {
            "type": "Degraded",
            "status": "False",
            "reason": "AllRanksReady",
            "lastTransitionTime": "2026-01-01T00:00:00Z",
        },
        {
            "type": "Ready",
            "status": "True",
            "reason": "AllRanksReady",
            "lastTransitionTime": "2026-01-01T00:00:00Z",
        },
    ],
}


def engine(api: ControlPlane) -> dict[str, Any]:
    """The stored smollm2 InferenceEngine."""
    obj = api.obj(IE, "default", "smollm2")
    assert obj is not None, "smollm2 does not exist"
    return obj


def register_node(api: ControlPlane, name: str) -> None:
    """A Node object with no kubelet behind it: pods bound to it are not garbage-collected as
    orphans (the pod GC force-deletes pods of a missing node), and nothing ever runs them."""
    api.request("POST", "/api/v1/nodes", {"metadata": {"name": name}}, expect=201)


def test_apply_then_get_ie_prints_the_printer_columns(api_server: ControlPlane) -> None:
    out = api_server.kubectl("apply", "-f", str(EXAMPLE)).stdout
    assert out.strip() == "inferenceengine.corefleet.dev/smollm2 created"
    [row] = parse_table(api_server.kubectl("get", "ie").stdout)
    assert list(row) == ["NAME", "RANKS", "READY", "ENDPOINT", "AGE"]
    assert row["NAME"] == "smollm2" and row["RANKS"] == row["READY"] == row["ENDPOINT"] == ""
    assert re.fullmatch(r"(\d+[smhdy])+", row["AGE"]), row  # the age the server computed

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
    waited = api_server.kubectl(
        "wait", "--for=condition=Ready", "ie/smollm2", "--timeout=60s", timeout=90
    )
    assert "condition met" in waited.stdout


def test_the_table_is_what_the_apiextensions_server_answers(api_server: ControlPlane) -> None:
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


def test_reapplying_a_changed_file_patches_the_spec(
    api_server: ControlPlane, tmp_path: Path
) -> None:
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


def test_scale_writes_data_parallel_size(api_server: ControlPlane) -> None:
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
    # the scale subresource goes through the CRD's schema: no more ranks than it allows
    refused = api_server.kubectl("scale", "ie/smollm2", "--replicas=2000", check=False)
    assert refused.returncode == 1
    assert (
        "spec.dataParallelSize: Invalid value: 2000: spec.dataParallelSize in body should be "
        "less than or equal to 1024"
    ) in refused.stderr
    assert engine(api_server)["spec"]["dataParallelSize"] == 2


class _Player:
    """Plays the operator and the kubelet from a thread until `stop`: removes the engine's
    finalizer once it is terminating (after a delay kubectl must wait through) and finishes
    terminating pods. `seen` gets "engine", then (pod name, its deletionGracePeriodSeconds) for
    each pod finished; `released` the monotonic time its removal was sent."""

    def __init__(self, api: ControlPlane) -> None:
        self.api = api
        self.stop = threading.Event()
        self.seen: list[Any] = []
        self.released: list[float] = []
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # reported by the test, not lost in the thread
            self.errors.append(exc)

    def _loop(self) -> None:
        api, done = self.api, set[str]()
        while not self.stop.is_set():
            obj = api.obj(IE, "default", "smollm2")
            if obj and obj["metadata"].get("deletionTimestamp") and "engine" not in self.seen:
                self.seen.append("engine")
                time.sleep(0.5)
                body = {"metadata": {"finalizers": None}}
                # Stamped before the PATCH: the object can go (and kubectl return) while its
                # answer is still on the way back to this thread (CI saw 1.5 ms of that).
                self.released.append(time.monotonic())
                api.request("PATCH", f"{IE_URL}/smollm2", body, content_type=MERGE, expect=200)
            for pod in api.objs("v1/pods", "default"):
                meta = pod["metadata"]
                if meta.get("deletionTimestamp") and meta["name"] not in done:
                    done.add(meta["name"])
                    self.seen.append((meta["name"], meta["deletionGracePeriodSeconds"]))
                    body = {"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}}
                    url = f"/api/v1/namespaces/default/pods/{meta['name']}"
                    api.request("DELETE", url, body, expect=200)
            time.sleep(0.2)


def test_kubectl_delete_waits_while_operator_gc_and_kubelet_finish(
    api_server: ControlPlane,
) -> None:
    register_node(api_server, "node-1")
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

    player = _Player(api_server)
    player.thread.start()
    try:
        out = api_server.kubectl("delete", "ie", "smollm2", timeout=180).stdout
        returned = time.monotonic()
        assert out.strip() == 'inferenceengine.corefleet.dev "smollm2" deleted'
        assert api_server.obj(IE, "default", "smollm2") is None
        assert player.released, "kubectl delete returned before the finalizer was removed"
        assert returned >= player.released[0]
        # The controller manager's garbage collector deletes the pods once it watches engines
        # (it rediscovers resources every 30 s); the player finishes them as a kubelet would.
        wait_until(
            lambda: player.errors or not api_server.objs("v1/pods", "default"),
            240,
            interval=0.5,
            what="the engine's pods gone",
        )
        assert not player.errors, player.errors
        # garbage collection deleted the pods gracefully: with their own grace period
        assert player.seen[0] == "engine"
        assert sorted(player.seen[1:]) == [("smollm2-engine-0", 30), ("smollm2-engine-1", 30)]
    finally:
        player.stop.set()
        player.thread.join(30)


def test_delete_with_wait_false_returns_while_the_finalizer_holds(
    api_server: ControlPlane,
) -> None:
    api_server.kubectl("apply", "-f", str(EXAMPLE))
    finalizer = json.dumps({"metadata": {"finalizers": ["corefleet.dev/cleanup"]}})
    api_server.kubectl("patch", "ie", "smollm2", "--type", "merge", "-p", finalizer)
    out = api_server.kubectl("delete", "-f", str(EXAMPLE), "--wait=false").stdout
    assert out.strip() == 'inferenceengine.corefleet.dev "smollm2" deleted'
    meta = engine(api_server)["metadata"]
    assert meta["deletionTimestamp"] and meta["deletionGracePeriodSeconds"] == 0
    assert parse_table(api_server.kubectl("get", "ie").stdout)[0]["NAME"] == "smollm2"
    remove = json.dumps([{"op": "remove", "path": "/metadata/finalizers"}])
    api_server.kubectl("patch", "ie", "smollm2", "--type", "json", "-p", remove)
    assert api_server.obj(IE, "default", "smollm2") is None
    assert "No resources found" in api_server.kubectl("get", "ie").stderr


def _lines(stream: Any, into: queue.Queue[str]) -> None:
    for line in stream:
        into.put(line)


def test_get_watch_prints_rows_as_the_engine_changes(api_server: ControlPlane) -> None:
    api_server.kubectl("apply", "-f", str(EXAMPLE))
    assert KUBECTL is not None
    cmd = [KUBECTL, f"--cache-dir={api_server.folder / 'kube-cache'}", "get", "ie", "-w"]
    watcher = subprocess.Popen(cmd, env=api_server.env(), stdout=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_lines, args=(watcher.stdout, lines), daemon=True).start()
    try:
        assert lines.get(timeout=60).split() == ["NAME", "RANKS", "READY", "ENDPOINT", "AGE"]
        assert lines.get(timeout=60).split()[0] == "smollm2"
        api_server.patch_status(IE, "default", "smollm2", READY_STATUS)
        row = ["smollm2", "2/2", "True", READY_STATUS["endpoint"]]
        assert lines.get(timeout=60).split()[:4] == row
    finally:
        watcher.kill()
        watcher.wait(30)


def _read_watch(api: ControlPlane, url: str, into: queue.Queue[Any]) -> None:
    """Put each line of a watch on `into`, then None at its end, or the error that ended it."""
    end: Any = None
    try:
        request = urllib.request.Request(api.url + url)
        with urllib.request.urlopen(request, timeout=300, context=api.tls) as answer:
            for line in answer:
                into.put(line.decode())
    except Exception as exc:  # the server going away may cut a chunk short
        end = exc
    into.put(end)


def _live_watch(api: ControlPlane) -> queue.Queue[Any]:
    """A watch on ConfigMaps that has delivered an event the test caused: it is open and live.

    Right after the server starts, a watch can end at once with a 504 ERROR event ("Too large
    resource version": the watch cache has not caught up with etcd yet) that clients retry; so
    does this, a few times."""
    cms = "/api/v1/namespaces/default/configmaps"
    for _ in range(10):
        _, mark = api.request("POST", cms, {"metadata": {"generateName": "mark-"}}, expect=201)
        version = mark["metadata"]["resourceVersion"]
        lines: queue.Queue[Any] = queue.Queue()
        url = f"{cms}?watch=1&resourceVersion={version}"
        threading.Thread(target=_read_watch, args=(api, url, lines), daemon=True).start()
        _, probe = api.request("POST", cms, {"metadata": {"generateName": "probe-"}}, expect=201)
        first = lines.get(timeout=120)
        if isinstance(first, str) and probe["metadata"]["name"] in first:
            return lines
        time.sleep(1)  # an ERROR event (then the end of that watch): try again
    raise AssertionError("no watch stayed open")


def test_stopping_the_server_ends_open_watches(tmp_path: Path) -> None:
    with ControlPlane(tmp_path, controller_manager=False, scheduler=False) as api:
        lines = _live_watch(api)
    # the control plane is stopped: the open watch has ended, on the client's side too
    while isinstance(end := lines.get(timeout=120), str):
        pass  # events the watch still delivered
    assert not isinstance(end, TimeoutError), "the watch outlived the API server"
