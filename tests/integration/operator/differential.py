"""Differential testing of the emulator against a real kube-apiserver: clients, transcripts, diff.

A scenario is a function of a `Recorder`: it sends requests (`call`) and reads watches (`watch`)
and may use earlier answers (a resourceVersion, a uid) in later requests. The same function runs
once against each server; every answer is recorded, and `differences` compares the two
transcripts step by step.

What must agree (`diff`):
- the HTTP status, and for an error `Status` its `reason` and `message` (the real server's text
  is the truth, CEL rule messages included);
- each body's shape: `kind`, `apiVersion`, and at every level the set of keys, after dropping
  `managedFields` (server-side apply bookkeeping, not emulated) and blanking volatile values
  (uid, resourceVersion, timestamps, generated names, cluster IPs): only their presence counts;
- every other scalar value (generation, finalizers, labels, defaults, replicas, ...);
- a watch's events: the sequence of (type, object name) of ADDED, MODIFIED, DELETED and ERROR
  events, each object's shape; a BOOKMARK's shape where both servers sent one, not whether one
  came: when a server sends them is its own business (the real one sometimes does in a watch of
  3 s, 2 s before its end, sometimes not).
Two rules are relaxed, and say so in `KNOWN`: outside `metadata` of built-in kinds the real
server fills defaults the emulator does not (a pod's dnsPolicy, a Service's clusterIP, ...):
there the emulator's keys must be a subset of the real server's, the values of shared keys
equal; and several errors of one 422 are compared in sorted order. What no scenario compares is
in `KNOWN_GAPS`, with the reason. `both_servers` starts the pair, `compare` runs a scenario.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import pathlib
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import yaml
from control_plane import ControlPlane
from kubeemu import KubeEmu
from kubeemu_server import ServedInThread

JSON = "application/json"
VOLATILE = {
    "uid",
    "resourceVersion",
    "creationTimestamp",
    "deletionTimestamp",
    "lastTransitionTime",
    "lastUpdateTime",
    "lastHeartbeatTime",
    "lastProbeTime",
    "firstTimestamp",
    "lastTimestamp",
    "eventTime",
    "clusterIP",
    "clusterIPs",
    "selfLink",
}
DROPPED = {"managedFields"}
BUILTIN_GROUPS = {"v1", "apps/v1", "policy/v1", "autoscaling/v2", "networking.k8s.io/v1"}
KNOWN = {
    "builtin-defaults": (
        "built-in kinds: the real server fills defaults under spec and status (a pod's "
        "dnsPolicy, restartPolicy, tolerations; a Service's clusterIP, ipFamilies; a "
        "Deployment's template); the emulator fills only a Deployment's replicas, strategy, "
        "revisionHistoryLimit and progressDeadlineSeconds: there its keys must be a subset of "
        "the real server's"
    ),
    "error-order": (
        "a 422 with several errors: the real server lists schema errors in Go's map order, "
        "which changes from one request to the next; the emulator by field name. The causes "
        "and the message's list are compared in sorted order"
    ),
}


class Recorder:
    """A client of one server that records every answer: (label, status, body)."""

    def __init__(self, name: str, url: str, tls: ssl.SSLContext | None) -> None:
        self.name, self.url, self.tls = name, url, tls
        self.transcript: list[tuple[str, int, Any]] = []

    def raw(
        self, method: str, path: str, body: Any = None, ctype: str = JSON, timeout: float = 30.0
    ) -> tuple[int, Any]:
        """One request, not recorded: (status, decoded JSON or text)."""
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": ctype, "Accept": JSON}
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout, context=self.tls) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as err:
            status, raw = err.code, err.read()
        text = raw.decode(errors="replace")
        try:
            return status, json.loads(text) if text.strip() else None
        except ValueError:
            return status, text

    def call(self, label: str, method: str, path: str, body: Any = None, ctype: str = JSON) -> Any:
        """One recorded request; returns the decoded answer."""
        status, answer = self.raw(method, path, body, ctype)
        self.transcript.append((label, status, answer))
        return answer

    def watch(self, label: str, path: str, timeout_seconds: int = 3) -> list[dict[str, Any]]:
        """A recorded watch that the server ends after `timeout_seconds`: its events."""
        sep = "&" if "?" in path else "?"
        status, text = self.raw("GET", f"{path}{sep}watch=true&timeoutSeconds={timeout_seconds}")
        if isinstance(text, dict):  # one event only: decoded as a document
            text = json.dumps(text)
        lines = text.splitlines() if isinstance(text, str) else []
        events = [json.loads(line) for line in lines if line.strip()]
        self.transcript.append((label, status, {"watch": events}))
        return events


Scenario = Callable[[Recorder, str], None]


def _blank(key: str, value: Any) -> Any:
    if key in VOLATILE and value not in (None, "", [], {}):
        return "<volatile>"
    if key == "name" and isinstance(value, str) and value.startswith("gen-"):
        return "<generated>"  # metadata.generateName "gen-" + a random suffix
    return value


def _builtin_object(body: Mapping[str, Any]) -> bool | None:
    """Whether a dict is an object of a built-in kind (None: not an object at all)."""
    if "apiVersion" not in body or "kind" not in body:
        return None
    return body.get("apiVersion") in BUILTIN_GROUPS and body.get("kind") != "Status"


def diff(emu: Any, real: Any, where: str = "", root: str = "", builtin: bool = False):
    """Every difference between two answers (see the module docstring), as `path: what`.
    `root` is the path of the object `where` lies in, `builtin` whether it is of a built-in kind."""
    if isinstance(emu, Mapping) and isinstance(real, Mapping):
        kind = _builtin_object(real)
        if kind is not None:
            root, builtin = where, kind
        emu_keys, real_keys = set(emu) - DROPPED, set(real) - DROPPED
        if builtin and not where[len(root) :].startswith(".metadata"):
            missing = emu_keys - real_keys  # KNOWN["builtin-defaults"]: no invented keys
        else:
            missing = emu_keys ^ real_keys
        for key in sorted(missing):
            side = "emulator" if key in emu_keys else "real server"
            yield f"{where}.{key}: only the {side} has it"
        for key in sorted(emu_keys & real_keys):
            a, b = _blank(key, emu[key]), _blank(key, real[key])
            yield from diff(a, b, f"{where}.{key}", root, builtin)
        return
    if isinstance(emu, list) and isinstance(real, list):
        if len(emu) != len(real):
            yield f"{where}: {len(emu)} items on the emulator, {len(real)} on the real server"
        for i, (a, b) in enumerate(zip(emu, real, strict=False)):
            yield from diff(a, b, f"{where}[{i}]", root, builtin)
        return
    if emu != real:
        yield f"{where}: emulator {emu!r}, real server {real!r}"


def watch_summary(events: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(type, object name) of every event but BOOKMARKs."""
    return [
        (e["type"], ((e.get("object") or {}).get("metadata") or {}).get("name", ""))
        for e in events
        if e["type"] != "BOOKMARK"
    ]


def _first_bookmark(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == "BOOKMARK"][:1]


def sorted_errors(body: Any) -> Any:
    """A 422 Status with its causes, and the message's list of them, in sorted order
    (KNOWN["error-order"]); anything else as it is."""
    causes = ((body.get("details") or {}).get("causes") or []) if isinstance(body, dict) else []
    if len(causes) < 2 or " is invalid: [" not in str(body.get("message")):
        return body
    prefix, rest = body["message"].split(" is invalid: ", 1)
    items = list(dict.fromkeys(f"{c['field']}: {c['message']}" for c in causes))
    message = body["message"]
    if len(rest) == len(", ".join(items)) + 2 and all(item in rest for item in items):
        message = f"{prefix} is invalid: [" + ", ".join(sorted(items)) + "]"
    ordered = sorted(causes, key=lambda c: (c["field"], c["message"]))
    return {**body, "details": {**body["details"], "causes": ordered}, "message": message}


def differences(emu: Recorder, real: Recorder) -> list[str]:
    """Every difference between two transcripts of the same scenario."""
    found: list[str] = []
    if [t[0] for t in emu.transcript] != [t[0] for t in real.transcript]:
        return [f"the scenario took other steps: {emu.transcript} vs {real.transcript}"]
    for (label, emu_status, emu_body), (_, real_status, real_body) in zip(
        emu.transcript, real.transcript, strict=True
    ):
        if emu_status != real_status:
            found.append(f"{label}: HTTP {emu_status} on the emulator, {real_status} on the real")
            found.append(f"  emulator: {str(emu_body)[:600]}\n  real: {str(real_body)[:600]}")
            continue
        if isinstance(real_body, Mapping) and "watch" in real_body:
            emu_events, real_events = emu_body["watch"], real_body["watch"]
            if watch_summary(emu_events) != watch_summary(real_events):
                found.append(
                    f"{label}: events {watch_summary(emu_events)} on the emulator, "
                    f"{watch_summary(real_events)} on the real server"
                )
                continue
            emu_marks, real_marks = _first_bookmark(emu_events), _first_bookmark(real_events)
            if not (emu_marks and real_marks):  # a bookmark's timing is not compared
                emu_marks = real_marks = []
            emu_events = [e for e in emu_events if e["type"] != "BOOKMARK"] + emu_marks
            real_events = [e for e in real_events if e["type"] != "BOOKMARK"] + real_marks
            found += [f"{label}: {d}" for d in diff(emu_events, real_events)]
            continue
        found += [f"{label}: {d}" for d in diff(sorted_errors(emu_body), sorted_errors(real_body))]
    return found


# --- running a scenario against both servers

REPO = pathlib.Path(__file__).resolve().parents[3]
IE_CRD = yaml.safe_load((REPO / "crds" / "inferenceengines.corefleet.dev.yaml").read_text())
CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
# What no scenario compares, and why:
# - faults the emulator makes on demand and a real server only by chance or after minutes
#   (test_operator_resilience.py uses them): a watch from a resourceVersion older than the
#   history (410 Expired: the real server keeps minutes of events, etcd compacts every 5 min),
#   429 and 5xx answers, a watch the server ends on request;
# - periodic BOOKMARKs: the real server sends one about once a minute and, in a watch with a
#   timeout, one 2 s before it ends if its bookmark timer (about every second) catches that
#   moment: in a watch of 3 s, sometimes one, sometimes none (CI saw both). The emulator sends
#   one after `bookmark_seconds` (60) without an event. Only their shape is compared, where both
#   sent one;
# - `sendInitialEvents` watches: this control plane answers them 500 ("the required storage
#   feature RequestWatchProgress is disabled"), the emulator serves them (kubectl's streaming
#   list);
# - garbage collection and pod termination: the controller manager's and the kubelet's work on
#   a real cluster (none runs here), the emulator's inside the request (`kubeemu_lifecycle`);
#   the operator tests that rely on them run against the real controllers.
KNOWN_GAPS = (
    "410 Expired",
    "429",
    "5xx",
    "an ended watch",
    "BOOKMARK timing",
    "sendInitialEvents",
    "garbage collection",
    "pod termination",
)
_names = itertools.count()


@contextlib.contextmanager
def both_servers(folder: pathlib.Path) -> Iterator[tuple[str, ControlPlane]]:
    """The emulator's URL and a real control plane (no controllers), both with the
    InferenceEngine CRD served."""
    emu = KubeEmu()
    plane = ControlPlane(folder, controller_manager=False, scheduler=False)
    with ServedInThread(emu) as url, plane as api:
        emulator = Recorder("emulator", url, None)
        for recorder in (emulator, Recorder("real", api.url, api.tls)):
            status, answer = recorder.raw("POST", CRDS, IE_CRD)
            assert status == 201, answer
            _wait_served(recorder, "/apis/corefleet.dev/v1alpha1")
        yield url, api


def _wait_served(recorder: Recorder, group_version: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while recorder.raw("GET", group_version)[0] != 200:
        assert time.monotonic() < deadline, f"{group_version} never served by {recorder.name}"
        time.sleep(0.1)


def compare(servers: tuple[str, ControlPlane], scenario: Scenario) -> None:
    """Run `scenario` against both servers, each in a fresh namespace; fail on a difference."""
    url, api = servers
    namespace = f"diff-{next(_names)}"
    emulator, real = Recorder("emulator", url, None), Recorder("real", api.url, api.tls)
    for recorder in (emulator, real):
        status, answer = recorder.raw(
            "POST", "/api/v1/namespaces", {"metadata": {"name": namespace}}
        )
        assert status == 201, answer
    # Pod admission needs the namespace's `default` ServiceAccount (the controller manager's
    # job; none runs). The emulator has no ServiceAccounts and no admission.
    account = {"metadata": {"name": "default"}}
    status, answer = real.raw("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts", account)
    assert status == 201, answer
    scenario(emulator, namespace)
    scenario(real, namespace)
    found = differences(emulator, real)
    if found:  # both transcripts, next to the control plane's logs
        dump = api.folder / f"{namespace}.json"
        both = {"emulator": emulator.transcript, "real": real.transcript}
        dump.write_text(json.dumps(both, indent=1))
        found.append(f"(both transcripts: {dump})")
    assert not found, "\n".join(found)


def engine(name: str = "llama", **spec: Any) -> dict[str, Any]:
    body = {"image": "corefleet:test", "model": {"path": "/m"}, "dataParallelSize": 1, **spec}
    return {
        "apiVersion": "corefleet.dev/v1alpha1",
        "kind": "InferenceEngine",
        "metadata": {"name": name},
        "spec": body,
    }


def ies(ns: str) -> str:
    return f"/apis/corefleet.dev/v1alpha1/namespaces/{ns}/inferenceengines"


def core(ns: str, plural: str) -> str:
    return f"/api/v1/namespaces/{ns}/{plural}"
