"""KubeEmu: a stateful Kubernetes API emulator for operator and end-to-end tests, on kmock 0.8.

kmock's `KubernetesScaffold` gives the HTTP server, discovery, the request log and its reaction DSL
(`emu['post', kmock.resource('v1/pods')] << 500` still works for fault injection);
`kubeemu_discovery` declares the resources. The store is our own, because stock `KubernetesEmulator`
lacks what kopf and kubectl need: server-filled
uid/resourceVersion/creationTimestamp/generation/kind/apiVersion, 409 on stale writes, 422 on a
failed JSON-patch test, status-subresource isolation, `/scale` through the CRD's `specReplicasPath`,
label/field selectors, watches that resume from a resourceVersion (410 Expired past the replay
window) and honour `timeoutSeconds`, 201 on create, CRD schema defaulting (and a Deployment's
replicas), `pods/binding` and `pods/log` through a hook (`kubeemu_pods`), deletecollection,
server-side printing for kubectl (`kubeemu_table`, `kubeemu_printers`), strategic merge
patches (a subset, `kubeemu_model`), deletion with finalizers, graceful pod termination and garbage
collection, Foreground included (`kubeemu_lifecycle`), CRD establishment and clean-up with the real
server's 404 for kinds it does not serve (`kubeemu_crds`, `crd_establish_seconds`), the update
rules (`kubeemu_writes`), watch bookmarks (`bookmark_seconds`), and O(1) dispatch while no reaction
is declared (kmock re-filters its request log per request). docs/local-cluster.md lists the
conventions and their tests.

Pod deletion, three ways:
- default (`kubelet_finalizes_pods` True unless `pod_termination_seconds` is given), as the real
  server: DELETE of a scheduled pod (`spec.nodeName` set, not Succeeded/Failed) sets
  `deletionTimestamp` (now + grace) and `deletionGracePeriodSeconds` (DeleteOptions'
  gracePeriodSeconds from the body or query, else `spec.terminationGracePeriodSeconds`, else 30)
  and keeps the pod until a DELETE with gracePeriodSeconds=0 (the kubelet's, once the containers
  stopped) removes it. Unscheduled or finished pods go at once. Garbage collection deletes pods
  the same way;
- `pod_termination_seconds=S`: every pod lingers with a deletionTimestamp for S seconds, then
  goes (a stand-in kubelet, for tests of draining without one);
- `kubelet_finalizes_pods=False`: a pod without finalizers goes at once, like any object.
In every mode finalizers hold an object until they are removed.

Custom resources are pruned, defaulted and validated (schema and CEL) as the real server does
(`kubeemu_schema`); `test_kubeemu_differential.py` holds the emulator's answers to the real
server's. Not emulated: controllers (tests or the e2e kubelet play them), validation of built-in
kinds (but names), server-side apply, protobuf bodies, dryRun, RBAC and admission, namespace
existence, CRD versions' conversion. Such requests, like every refused
one, get a `v1 Status` answer with the real server's code and reason (`kubeemu_request`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import uuid
from typing import Any

import aiohttp.web
import attrs
import kmock
from kubeemu_crds import CRDS, CrdControllers
from kubeemu_discovery import ResourceType
from kubeemu_lifecycle import Key, Lifecycle
from kubeemu_model import now_rfc3339
from kubeemu_openapi import OpenApiScaffold
from kubeemu_pods import PodEndpoints, PodLogs
from kubeemu_reads import Reads, _gv
from kubeemu_request import (
    StatusError,
    already_exists,
    check_content_type,
    check_not_dry_run,
    delete_options,
    json_body,
    not_found,
    object_details,
    resource_name,
    response_format,
)
from kubeemu_watch import EventLog
from kubeemu_writes import (
    check_finalizers,
    check_resource_version,
    checked,
    isolated,
    next_generation,
    patched,
    tracks_generation,
)

__all__ = ["KubeEmu", "ResourceType"]
OBJECT_VIEWS = (None, "status", "scale")  # subresources read and written as (part of) the object


def _json(body: Any, status: int = 200) -> aiohttp.web.Response:
    return aiohttp.web.json_response(body, status=status)


@attrs.define(kw_only=True)
class KubeEmu(Reads, PodEndpoints, CrdControllers, Lifecycle, OpenApiScaffold):
    """The emulator; serve it with `kubeemu_server.serve` or `ServedInThread`."""

    pod_termination_seconds: float | None = None  # S: every deleted pod lingers S seconds
    kubelet_finalizes_pods: bool | None = None  # scheduled pods wait for the kubelet's delete
    history_size: int = 5000  # watch events kept for resuming from a resourceVersion
    pod_logs: PodLogs | None = None  # serves `kubectl logs` (see kubeemu_pods)
    crd_establish_seconds: float = 0.0  # a CRD created through the API is served after this
    bookmark_seconds: float = 60.0  # a BOOKMARK after this long without an event, if allowed

    objects: dict[Key, dict[str, Any]] = attrs.field(factory=dict, init=False)
    deleted: list[dict[str, Any]] = attrs.field(factory=list, init=False)  # last states, in order
    delete_requests: list[Key] = attrs.field(factory=list, init=False)  # first DELETE of each
    _rv: Any = attrs.field(factory=lambda: itertools.count(1), init=False)
    _last_rv: int = attrs.field(default=0, init=False)
    _events: EventLog = attrs.field(init=False)
    _uids: set[str] = attrs.field(factory=set, init=False)
    _orphaning: set[str] = attrs.field(factory=set, init=False)  # uids deleted with Orphan
    _tasks: set[asyncio.Task[None]] = attrs.field(factory=set, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._events = EventLog(self.history_size)

    # --- direct access for assertions
    def obj(self, path: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The stored object (resource path like "v1/pods"), or None."""
        return self.objects.get((path, namespace, name))

    def objs(self, path: str, namespace: str | None = None) -> list[dict[str, Any]]:
        """Stored objects of a resource, optionally in one namespace."""
        return [
            o
            for (p, ns, _), o in list(self.objects.items())  # a snapshot: see ServedInThread
            if p == path and (namespace is None or ns == namespace)
        ]

    # --- dispatch
    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        res = request.resource
        if res is None or res.plural is None or f"{_gv(request)}/{res.plural}" not in self.types:
            return await super()._handle(request)
        if len(self._payloads) > self._builtin_payloads:  # reactions declared: honour them first
            with contextlib.suppress(kmock.KubernetesEndpointNotFoundError):
                return await super()._handle(request)
        try:
            return await self._serve(request, f"{_gv(request)}/{res.plural}")
        except StatusError as exc:
            return exc.response()

    async def _serve(self, request: kmock.Request, path: str) -> aiohttp.web.StreamResponse:
        method, ns, name = request.method.value.upper(), request.namespace or "", request.name
        sub, rtype = request.subresource, self.types[path]
        if sub is not None and (name is None or sub not in rtype.subresources):
            if rtype.crd is not None and name is not None:  # what the real server says
                raise not_found(path, name)
            raise StatusError(
                404, "NotFound", f"the server could not find the requested resource ({sub})"
            )
        fmt = "json"
        if method != "GET":
            check_not_dry_run(request.params)
        if method in ("POST", "PUT", "PATCH"):
            check_content_type(request.headers)  # before a 404: server-side apply creates
        if method == "GET":
            fmt = "json" if sub else response_format(request.headers)
            if request.params.get("watch") in ("true", "1"):
                return await self._watch(request, path, fmt)
            if name is None:
                return _json(self._list(request, path, fmt))
        elif name is None and method == "POST":
            return self._create(request, path, ns)
        elif name is None and method == "DELETE":
            return _json(self._delete_collection(request, path))
        if name is None:
            raise StatusError(405, "MethodNotAllowed", f"{method} on a collection")
        key: Key = (path, ns, name)
        if key not in self.objects:
            raise not_found(path, name)
        special = {("GET", "log"): self._log, ("POST", "binding"): self._bind}.get((method, sub))
        if special is not None:
            return special(request, key)
        if method == "GET" and sub in OBJECT_VIEWS:
            if fmt == "table":
                return _json(self._table(request, path, [self.objects[key]]))
            return _json(self._view(key, sub))
        if method in ("PATCH", "PUT") and sub in OBJECT_VIEWS:
            return self._update(request, key, method)
        if method == "DELETE" and sub is None:
            gone = self._delete(key, delete_options(request.body, request.params))
            return _json(self._deleted_answer(key, gone))
        raise StatusError(405, "MethodNotAllowed", f"{method} on {resource_name(path)}/{sub}")

    # --- writes
    def _create(self, request: kmock.Request, path: str, ns: str) -> aiohttp.web.Response:
        check_content_type(request.headers)
        body, rtype, gv = json_body(request.body, None), self.types[path], path.rsplit("/", 1)[0]
        if not isinstance(body, dict) or not isinstance(body.get("metadata", {}), dict):
            raise StatusError(400, "BadRequest", "the body must be a JSON object with metadata")
        if body.get("kind") not in (None, rtype.kind) or body.get("apiVersion") not in (None, gv):
            raise StatusError(
                400,
                "BadRequest",
                f"the body is a {body.get('apiVersion')} {body.get('kind')}, but the URL "
                f"is for {gv} {rtype.kind}",
            )
        meta = body.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if rtype.crd is not None and self._crd_terminating(rtype.crd):
            why = "create not allowed while custom resource definition is terminating"
            raise StatusError(405, "MethodNotAllowed", why)
        if rtype.namespaced and not ns:
            raise StatusError(405, "MethodNotAllowed", f"{rtype.kind} needs a namespace in the URL")
        if rtype.namespaced and meta.get("namespace") not in (None, "", ns):
            raise StatusError(
                400,
                "BadRequest",
                "the namespace of the provided object does not match the namespace sent on the "
                "request",
            )
        body.update(apiVersion=gv, kind=rtype.kind)
        if "status" in rtype.subresources and path not in ("v1/namespaces", CRDS):
            body.pop("status", None)
        body = checked(path, rtype, body)
        if path == CRDS:
            self._crd_check(body)
        meta = body["metadata"]
        if rtype.namespaced:
            meta["namespace"] = ns
        key: Key = (path, ns, meta["name"])
        if key in self.objects:
            raise already_exists(path, meta["name"])
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=now_rfc3339())
        if tracks_generation(path, rtype):
            meta["generation"] = 1
        meta["resourceVersion"] = self._next_rv()
        if path == CRDS:
            self._crd_created(body)  # answered before it is established
        self.objects[key] = body
        self._uids.add(meta["uid"])
        self._emit(path, "ADDED", body)
        answer = _json(body, 201)
        if path == CRDS:
            self._crd_establish_soon(key)
        owners = meta.get("ownerReferences") or []
        if owners and not any(o.get("uid") in self._uids for o in owners):
            self._delete(key)  # garbage: every owner is already gone
        return answer

    def _update(self, request: kmock.Request, key: Key, method: str) -> aiohttp.web.Response:
        current, rtype, sub = self.objects[key], self.types[key[0]], request.subresource
        new, want_rv = patched(request, current, method, rtype, key[0])
        check_resource_version(key[0], key[2], current, want_rv)
        new = isolated(rtype, key[0], sub, current, new)
        if not isinstance(new.get("metadata", {}), dict):
            raise StatusError(400, "BadRequest", "metadata must be an object")
        meta = new.setdefault("metadata", {})
        kept = ("uid", "creationTimestamp", "namespace", "name", "deletionTimestamp")
        for field in (*kept, "deletionGracePeriodSeconds", "generateName"):
            if field in current["metadata"]:
                meta[field] = current["metadata"][field]
        new.update(apiVersion=current.get("apiVersion"), kind=current.get("kind"))
        check_finalizers(key[0], rtype, current, new)
        new = checked(key[0], rtype, new)
        meta = new["metadata"]
        if tracks_generation(key[0], rtype):
            meta["generation"] = next_generation(rtype, current, new)
        meta["resourceVersion"] = self._next_rv()
        self.objects[key] = new
        self._emit(key[0], "MODIFIED", new)
        if key[0] == CRDS:
            self._crd_updated(new)
        if self._can_go(meta):
            self._remove(key)
        return _json(self._view(key, sub) if key in self.objects else new)

    def _deleted_answer(self, key: Key, obj: dict[str, Any]) -> dict[str, Any]:
        """What a DELETE answers: the object while something holds it (finalizers, a grace
        period); once it is gone, a pod as its deletion left it, a Service as it was, anything
        else a Status."""
        meta = obj["metadata"]
        held = self.objects.get(key)
        if held is not None and held["metadata"]["uid"] == meta["uid"]:
            return obj
        if key[0] == "v1/services":
            return obj
        if key[0] == "v1/pods":  # graceful deletion, cut to 0 for a pod on no node
            pod = json.loads(json.dumps(obj))
            if not meta.get("deletionTimestamp"):
                pod["metadata"]["deletionTimestamp"] = now_rfc3339()
                pod["metadata"]["deletionGracePeriodSeconds"] = 0
                if "generation" in meta:
                    pod["metadata"]["generation"] = int(meta["generation"]) + 1
            return pod
        details = object_details(key[0], key[2], uid=meta["uid"])
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Success",
            "details": details,
        }

    def _delete_collection(self, request: kmock.Request, path: str) -> dict[str, Any]:
        options = delete_options(request.body, request.params)
        gone = [self._delete(k, options) for k, _ in self._selected(request, path)]
        return {"apiVersion": _gv(request), "kind": f"{self.types[path].kind}List", "items": gone}

    def close_watches(self) -> None:
        """End every open watch stream, so that the server can stop at once."""
        self._events.close()

    async def __aexit__(self, *exc: Any) -> None:
        for task in list(self._tasks):
            task.cancel()
        await super().__aexit__(*exc)
