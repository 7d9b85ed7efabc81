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
- default: a pod without finalizers goes at once, like any object;
- `pod_termination_seconds=S`: pods linger with a deletionTimestamp for S seconds, then go;
- `kubelet_finalizes_pods=True`, as with a real kubelet: DELETE of a scheduled pod
  (`spec.nodeName` set, not Succeeded/Failed) sets `deletionTimestamp` (now + grace) and
  `deletionGracePeriodSeconds` (DeleteOptions' gracePeriodSeconds from the body or query, else
  `spec.terminationGracePeriodSeconds`, else 30) and keeps the pod until a DELETE with
  gracePeriodSeconds=0 (the kubelet's, once the containers stopped) removes it. Unscheduled or
  finished pods go at once. Garbage collection deletes pods the same way.
In every mode finalizers hold an object until they are removed.

Not emulated: controllers (tests or the e2e kubelet play them), schema validation and CEL (see
tests/unit/operator/test_operator_crd.py), server-side apply, protobuf bodies, dryRun, RBAC
and admission, namespace existence, CRD versions' conversion. Such requests, like every refused
one, get a `v1 Status` answer with the real server's code and reason (`kubeemu_request`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import uuid
from collections.abc import Mapping
from typing import Any

import aiohttp.web
import attrs
import kmock
from kubeemu_crds import CRDS, CrdControllers
from kubeemu_discovery import ResourceType
from kubeemu_lifecycle import Key, Lifecycle
from kubeemu_model import (
    apply_kind_defaults,
    fields_match,
    labels_match,
    now_rfc3339,
)
from kubeemu_openapi import OpenApiScaffold
from kubeemu_pods import PodEndpoints, PodLogs
from kubeemu_printers import printer_for
from kubeemu_request import (
    StatusError,
    check_content_type,
    check_name,
    check_not_dry_run,
    delete_options,
    json_body,
    not_found,
    resource_name,
    response_format,
)
from kubeemu_table import to_table
from kubeemu_watch import Event, EventLog, stream
from kubeemu_writes import (
    check_finalizers,
    check_resource_version,
    isolated,
    next_generation,
    patched,
    scale_view,
)

__all__ = ["KubeEmu", "ResourceType"]
OBJECT_VIEWS = (None, "status", "scale")  # subresources read and written as (part of) the object


def _gv(request: kmock.Request) -> str:
    res = request.resource
    assert res is not None
    return f"{res.group}/{res.version}" if res.group else str(res.version)


def _json(body: Any, status: int = 200) -> aiohttp.web.Response:
    return aiohttp.web.json_response(body, status=status)


@attrs.define(kw_only=True)
class KubeEmu(PodEndpoints, CrdControllers, Lifecycle, OpenApiScaffold):
    """The emulator; serve it with `kubeemu_server.serve` or `ServedInThread`."""

    pod_termination_seconds: float | None = None  # None: pods vanish at once when deleted
    kubelet_finalizes_pods: bool = False  # True: scheduled pods wait for the kubelet's delete
    history_size: int = 5000  # watch events kept for resuming from a resourceVersion
    pod_logs: PodLogs | None = None  # serves `kubectl logs` (see kubeemu_pods)
    crd_establish_seconds: float = 0.0  # a CRD created through the API is served after this
    bookmark_seconds: float = 1.0  # BOOKMARK events this often to watches that allow them

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
            return _json(self._delete(key, delete_options(request.body, request.params)))
        raise StatusError(405, "MethodNotAllowed", f"{method} on {resource_name(path)}/{sub}")

    # --- reads
    def _view(self, key: Key, subresource: str | None) -> dict[str, Any]:
        obj = self.objects[key]
        return scale_view(obj, self.types[key[0]]) if subresource == "scale" else obj

    def _table(self, request: kmock.Request, path: str, objs: list[Any]) -> dict[str, Any]:
        """A Table of objects; one object's Table carries that object's resourceVersion."""
        printer = printer_for(path, self.types[path].printer_columns)
        rv = objs[0]["metadata"]["resourceVersion"] if len(objs) == 1 else str(self._last_rv)
        return to_table(printer, objs, request.params, rv)

    def _selected(self, request: kmock.Request, path: str) -> list[tuple[Key, dict[str, Any]]]:
        try:
            fields_match({}, request.params.get("fieldSelector"))  # malformed: ValueError
            return [
                (k, o)
                for k, o in sorted(self.objects.items())
                if k[0] == path and self._matches(request, k[1], o)
            ]
        except ValueError as exc:
            raise StatusError(400, "BadRequest", f"fieldSelector: {exc}") from exc

    def _list(self, request: kmock.Request, path: str, fmt: str) -> dict[str, Any]:
        items = [o for _, o in self._selected(request, path)]
        if fmt == "table":
            return self._table(request, path, items)
        return {
            "apiVersion": _gv(request),
            "kind": f"{self.types[path].kind}List",
            "metadata": {"resourceVersion": str(self._last_rv)},
            "items": items,
        }

    def _matches(self, request: kmock.Request, ns: str, obj: Mapping[str, Any]) -> bool:
        meta = obj.get("metadata") or {}
        return (
            (not request.namespace or ns == request.namespace)
            and (request.name is None or meta.get("name") == request.name)
            and labels_match(meta.get("labels") or {}, request.params.get("labelSelector"))
            and fields_match(obj, request.params.get("fieldSelector"))
        )

    async def _watch(
        self, request: kmock.Request, path: str, fmt: str
    ) -> aiohttp.web.StreamResponse:
        assert request._raw_request is not None
        since = request.params.get("resourceVersion") or "0"
        if not since.isdigit():
            raise StatusError(400, "BadRequest", f"resourceVersion: invalid value {since!r}")
        self._selected(request, path)  # validates the selectors
        replay: list[dict[str, Any]] = []
        expired: StatusError | None = None
        if since == "0" or request.params.get("sendInitialEvents") == "true":
            replay = [{"type": "ADDED", "object": o} for _, o in self._selected(request, path)]
            if request.params.get("sendInitialEvents") == "true":
                meta = {
                    "resourceVersion": str(self._last_rv),
                    "annotations": {"k8s.io/initial-events-end": "true"},
                }
                gvk = {"apiVersion": _gv(request), "kind": self.types[path].kind}
                replay.append({"type": "BOOKMARK", "object": {**gvk, "metadata": meta}})
        else:
            try:
                replay = self._events.since(path, int(since))
            except StatusError as exc:
                expired = exc
        table = fmt == "table"

        def shown(event: Event) -> Event | None:
            obj = event["object"]
            if event["type"] == "BOOKMARK":
                return event
            if not self._matches(request, (obj.get("metadata") or {}).get("namespace", ""), obj):
                return None
            return {**event, "object": self._table(request, path, [obj])} if table else event

        timeout = float(request.params.get("timeoutSeconds") or 3600)
        kind = {"apiVersion": _gv(request), "kind": self.types[path].kind}

        def bookmark() -> Event:
            return {
                "type": "BOOKMARK",
                "object": {**kind, "metadata": {"resourceVersion": str(self._last_rv)}},
            }

        marks = bookmark if request.params.get("allowWatchBookmarks") == "true" else None
        queue = self._events.subscribe(path)
        try:
            return await stream(
                request._raw_request,
                replay,
                queue,
                shown,
                timeout,
                expired,
                marks,
                self.bookmark_seconds,
            )
        finally:
            self._events.unsubscribe(path, queue)

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
        if not meta.get("name"):
            raise StatusError(422, "Invalid", "metadata.name: Required value: name is required")
        check_name(meta["name"])
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
        key: Key = (path, ns, meta["name"])
        if key in self.objects:
            message = f'{resource_name(path)} "{meta["name"]}" already exists'
            raise StatusError(409, "AlreadyExists", message, {"name": meta["name"]})
        if rtype.namespaced:
            meta["namespace"] = ns
        meta.update(
            uid=str(uuid.uuid4()),
            creationTimestamp=now_rfc3339(),
            generation=1,
            resourceVersion=self._next_rv(),
        )
        body.update(apiVersion=gv, kind=rtype.kind)
        if "status" in rtype.subresources and path != "v1/namespaces":
            body.pop("status", None)
        apply_kind_defaults(rtype.schema, rtype.defaults, body)
        if path == CRDS:
            self._crd_created(body)  # its status; served now or once established
        self.objects[key] = body
        self._uids.add(meta["uid"])
        self._emit(path, "ADDED", body)
        owners = meta.get("ownerReferences") or []
        if owners and not any(o.get("uid") in self._uids for o in owners):
            self._delete(key)  # garbage: every owner is already gone
        return _json(body, 201)

    def _update(self, request: kmock.Request, key: Key, method: str) -> aiohttp.web.Response:
        current, rtype, sub = self.objects[key], self.types[key[0]], request.subresource
        new, want_rv = patched(request, current, method, rtype)
        check_resource_version(key[0], key[2], current, want_rv)
        new = isolated(rtype, key[0], sub, current, new)
        if not isinstance(new.get("metadata", {}), dict):
            raise StatusError(400, "BadRequest", "metadata must be an object")
        meta = new.setdefault("metadata", {})
        kept = ("uid", "creationTimestamp", "namespace", "name", "deletionTimestamp")
        for field in (*kept, "deletionGracePeriodSeconds"):
            if field in current["metadata"]:
                meta[field] = current["metadata"][field]
        new.update(apiVersion=current.get("apiVersion"), kind=current.get("kind"))
        check_finalizers(current, new)
        apply_kind_defaults(rtype.schema, rtype.defaults, new)
        meta["generation"] = next_generation(rtype, current, new)
        meta["resourceVersion"] = self._next_rv()
        self.objects[key] = new
        self._emit(key[0], "MODIFIED", new)
        if key[0] == CRDS:
            self._crd_updated(new)
        if self._can_go(meta):
            self._remove(key)
        return _json(self._view(key, sub) if key in self.objects else new)

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
