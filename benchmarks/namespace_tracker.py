"""Watches of one namespace, for benchmarks/operator_scale.py: what the operator made, and when.

`Tracker` lists and then watches, each from its own thread, the namespace's pods, the other
kinds the operator creates and the InferenceEngines; keeps a slim copy of each object; and
records, per phase, the first time each engine passed the phase's predicate (evaluated on every
event of that engine), and per pod when it was first seen, bound to a node and Running+Ready.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

from kwok_cluster import Component, ControlPlane

WATCH = "watch=1&allowWatchBookmarks=true&timeoutSeconds=300&resourceVersion="


def _slim(resource: str, obj: Mapping[str, Any]) -> dict[str, Any]:
    meta, status = obj.get("metadata") or {}, obj.get("status") or {}
    labels = meta.get("labels") or {}
    out = {
        "name": meta.get("name"),
        "uid": meta.get("uid"),
        "engine": labels.get("corefleet.dev/engine"),
        "component": labels.get("app.kubernetes.io/component"),
        "terminating": bool(meta.get("deletionTimestamp")),
    }
    if resource == "pods":
        conds = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
        out["ready"] = status.get("phase") == "Running" and conds.get("Ready") == "True"
        out["hash"] = (meta.get("annotations") or {}).get("corefleet.dev/spec-hash")
        out["bound"] = bool((obj.get("spec") or {}).get("nodeName"))
    elif resource == "inferenceengines":
        ready = [c for c in status.get("conditions") or [] if c.get("type") == "Ready"]
        generation = meta.get("generation")
        out["engine"] = meta.get("name")
        out["ready"] = bool(
            ready
            and ready[0].get("status") == "True"
            and ready[0].get("observedGeneration") == generation
            and status.get("observedGeneration") == generation
        )
        out["updated"] = status.get("updatedReplicas")
        out["generation"] = generation
    return out


class _Watch(threading.Thread):
    """List, then watch one collection; relist on 410 Gone or a closed stream."""

    def __init__(self, cp: ControlPlane, resource: str, path: str, tracker: Tracker) -> None:
        super().__init__(name=f"watch-{resource}", daemon=True)
        self.resource, self.path, self.tracker = resource, path, tracker
        parsed = urllib.parse.urlparse(cp.url)
        self.host, self.port, self.tls = parsed.hostname, parsed.port, cp.tls
        self.conn: http.client.HTTPSConnection | None = None
        self.error: BaseException | None = None

    def _get(self, query: str) -> http.client.HTTPResponse:
        self.conn = http.client.HTTPSConnection(self.host, self.port, context=self.tls, timeout=330)
        self.conn.request("GET", f"{self.path}?{query}", headers={"Accept": "application/json"})
        resp = self.conn.getresponse()
        if resp.status != 200:
            answer = resp.read()[:300]
            raise RuntimeError(f"GET {self.path}?{query}: HTTP {resp.status}: {answer!r}")
        return resp

    def run(self) -> None:
        try:
            while not self.tracker.stopped.is_set():
                body = json.loads(self._get("").read())
                self.tracker.replace(self.resource, body.get("items") or [])
                version = body["metadata"]["resourceVersion"]
                query = WATCH + version
                for line in self._get(query):
                    event = json.loads(line)
                    if event["type"] == "ERROR":
                        break  # 410 Gone: list again
                    if event["type"] != "BOOKMARK":
                        self.tracker.apply(self.resource, event["type"], event["object"])
        except (OSError, http.client.HTTPException, ValueError) as exc:
            if not self.tracker.stopped.is_set():
                self.error = exc
        except BaseException as exc:  # reported by Tracker.check
            self.error = exc

    def close(self) -> None:
        conn = self.conn
        if conn is not None and conn.sock is not None:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)


Predicate = Callable[[str, "Tracker"], bool]


class Tracker:
    """Watched state of one namespace, and per phase the first time each engine passed."""

    RESOURCES: ClassVar[dict[str, str]] = {
        "pods": "/api/v1/namespaces/{ns}/pods",
        "services": "/api/v1/namespaces/{ns}/services",
        "configmaps": "/api/v1/namespaces/{ns}/configmaps",
        "secrets": "/api/v1/namespaces/{ns}/secrets",
        "deployments": "/apis/apps/v1/namespaces/{ns}/deployments",
        "poddisruptionbudgets": "/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets",
        "networkpolicies": "/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies",
        "inferenceengines": "/apis/corefleet.dev/v1alpha1/namespaces/{ns}/inferenceengines",
    }

    def __init__(self, cp: ControlPlane, namespace: str) -> None:
        self.stopped = threading.Event()
        self.lock = threading.Condition()
        self.state: dict[str, dict[str, dict[str, Any]]] = {r: {} for r in self.RESOURCES}
        self.by_engine: dict[str, set[tuple[str, str]]] = {}
        self.phases: dict[str, tuple[Predicate, set[str], dict[str, float]]] = {}
        self.first_seen: dict[str, float] = {}  # engine -> when its InferenceEngine appeared
        self.spec_seen: dict[tuple[str, int], float] = {}  # (engine, generation) -> first seen
        # pod uid -> (component, seen, bound, ready): when the watch first showed it, with a
        # node (the scheduler's binding) and Running+Ready (kwok's pod-ready Stage); monotonic.
        self.pod_times: dict[str, list[Any]] = {}
        self.watches = [
            _Watch(cp, r, p.format(ns=namespace), self) for r, p in self.RESOURCES.items()
        ]

    def __enter__(self) -> Tracker:
        for watch in self.watches:
            watch.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        for watch in self.watches:
            watch.close()
        for watch in self.watches:
            watch.join(10)

    def check(self) -> None:
        """Raise what a watch thread met."""
        for watch in self.watches:
            if watch.error is not None:
                raise RuntimeError(f"watch of {watch.resource} failed: {watch.error!r}")

    # --- updates, from the watch threads
    def replace(self, resource: str, items: Iterable[Mapping[str, Any]]) -> None:
        with self.lock:
            for name in list(self.state[resource]):
                self._remove(resource, name)
            for obj in items:
                self._put(resource, obj)

    def apply(self, resource: str, kind: str, obj: Mapping[str, Any]) -> None:
        with self.lock:
            if kind == "DELETED":
                self._remove(resource, obj["metadata"]["name"])
            else:
                self._put(resource, obj)

    def _put(self, resource: str, obj: Mapping[str, Any]) -> None:
        slim = _slim(resource, obj)
        self.state[resource][slim["name"]] = slim
        if resource == "pods" and slim["engine"]:
            now = time.monotonic()
            times = self.pod_times.setdefault(slim["uid"], [slim["component"], now, None, None])
            times[2] = times[2] or (now if slim["bound"] else None)
            times[3] = times[3] or (now if slim["ready"] else None)
        if slim["engine"]:
            self.by_engine.setdefault(slim["engine"], set()).add((resource, slim["name"]))
            if resource == "inferenceengines":
                self.first_seen.setdefault(slim["name"], time.monotonic())
                self.spec_seen.setdefault((slim["name"], slim["generation"]), time.monotonic())
            self._evaluate(slim["engine"])

    def _remove(self, resource: str, name: str) -> None:
        slim = self.state[resource].pop(name, None)
        if slim and slim["engine"]:
            self.by_engine.get(slim["engine"], set()).discard((resource, name))
            self._evaluate(slim["engine"])

    def _evaluate(self, engine: str) -> None:
        now = time.monotonic()
        for predicate, engines, done in self.phases.values():
            if engine in engines and engine not in done and predicate(engine, self):
                done[engine] = now
                self.lock.notify_all()

    # --- queries, under the lock (predicates run there)
    def children(self, engine: str, resource: str | None = None) -> list[dict[str, Any]]:
        """The engine's objects (of one resource)."""
        keys = self.by_engine.get(engine, set())
        return [self.state[r][n] for r, n in keys if resource in (None, r) and n in self.state[r]]

    def snapshot(self, engine: str) -> list[dict[str, Any]]:
        """A copy of the engine's rank pods."""
        with self.lock:
            return [dict(p) for p in self.children(engine, "pods") if p["component"] == "engine"]

    # --- phases, from the main thread
    def start_phase(self, name: str, predicate: Predicate, engines: Iterable[str]) -> None:
        """From now on, record when each of `engines` first passes `predicate`."""
        with self.lock:
            wanted = set(engines)
            self.phases[name] = (predicate, wanted, {})
            for engine in wanted:
                self._evaluate(engine)

    def wait_phase(self, name: str, timeout: float, alive: Iterable[Component]) -> dict[str, float]:
        """Block until every engine of the phase passed; its times (monotonic) per engine."""
        deadline = time.monotonic() + timeout
        _, engines, done = self.phases[name]
        with self.lock:
            while len(done) < len(engines):
                self.check()
                for component in alive:
                    component.check_alive()
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{name}: {len(done)}/{len(engines)} engines after {timeout:.0f}s"
                    )
                self.lock.wait(1.0)
            return dict(done)

    def pod_latencies(self, since: float, until: float) -> dict[str, dict[str, list[float]]]:
        """For pods first seen in [since, until) (monotonic), per component: seconds from seen
        to bound ("schedule") and from bound to Running+Ready ("kwok")."""
        out: dict[str, dict[str, list[float]]] = {}
        with self.lock:
            for component, seen, bound, ready in self.pod_times.values():
                if not since <= seen < until:
                    continue
                mine = out.setdefault(component, {"schedule": [], "kwok": []})
                if bound is not None:
                    mine["schedule"].append(bound - seen)
                    if ready is not None:
                        mine["kwok"].append(ready - bound)
        return out

    def progress(self, name: str) -> int:
        with self.lock:
            return len(self.phases[name][2])
