"""KubeEmu: a stateful Kubernetes API emulator for operator tests, built on kmock 0.8.

kmock's `KubernetesScaffold` gives the HTTP server, discovery (`/api`, `/apis/...`), the request
log and kmock's reaction DSL (`emu['post', kmock.resource('v1/pods')] << 500` still works for fault
injection). The object store is our own, because stock `KubernetesEmulator` lacks what kopf needs
(see shared/reference/kmock-operator-testing.md): server-filled uid/resourceVersion/
creationTimestamp/generation, resourceVersion bumped on every write, 409 on stale writes, 422 on a
failed JSON-patch test, status-subresource isolation, `/scale` mapped through the CRD's
`specReplicasPath`, label/field selectors, watches that resume from a resourceVersion (with a replay
window) and honour `timeoutSeconds`, 201 on create, and the `/api/v1/namespaces` URL that kmock's
parser crashes on. On top of the reference note's KubeEmu it adds CRD schema defaulting, garbage
collection through ownerReferences, graceful pod termination (pods linger with a
deletionTimestamp for `pod_termination_seconds`), and O(1) dispatch while no reaction is
declared (kmock re-filters its whole request log per request, which slows long tests down).

Not emulated: controllers (Deployments make no pods; the test plays kubelet and controllers by
patching `/status`), schema validation and CEL (see tests/unit/operator/test_operator_crd.py),
strategic-merge list semantics, server-side apply, RBAC.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import uuid
from collections.abc import Mapping
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import kmock
from kmock._internal import parsing
from kubeemu_model import (
    apply_defaults,
    fields_match,
    get_path,
    labels_match,
    merge_patch,
    now_rfc3339,
    set_path,
)

Key = tuple[str, str, str]  # (resource path "group/version/plural", namespace or "", name)
VERBS = {"create", "delete", "get", "list", "patch", "update", "watch"}
BUILTINS = [  # (group/version, plural, kind, namespaced, subresources)
    ("v1", "namespaces", "Namespace", False, {"status"}),
    ("v1", "pods", "Pod", True, {"status"}),
    ("v1", "services", "Service", True, {"status"}),
    ("v1", "configmaps", "ConfigMap", True, set()),
    ("v1", "secrets", "Secret", True, set()),
    ("v1", "events", "Event", True, set()),
    ("v1", "persistentvolumeclaims", "PersistentVolumeClaim", True, {"status"}),
    ("apps/v1", "deployments", "Deployment", True, {"status", "scale"}),
    ("policy/v1", "poddisruptionbudgets", "PodDisruptionBudget", True, {"status"}),
    ("networking.k8s.io/v1", "networkpolicies", "NetworkPolicy", True, set()),
    (
        "apiextensions.k8s.io/v1",
        "customresourcedefinitions",
        "CustomResourceDefinition",
        False,
        set(),
    ),
]


def _parse_path(path: str) -> parsing.ParsedPath:
    # kmock 0.8 fails to unpack /api/v1/namespaces[/NAME[/status]] (a cluster-scoped resource).
    parts = path.strip("/").split("/")
    if parts[:3] == ["api", "v1", "namespaces"] and (len(parts) <= 4 or parts[4] == "status"):
        name = parts[3] if len(parts) > 3 else None
        sub = parts[4] if len(parts) > 4 else None
        return parsing.ParsedPath("", "v1", "namespaces", None, name, sub)
    return _original_parse_path(path)


_original_parse_path = parsing.parse_path
parsing.parse_path = _parse_path


def _gv(request: kmock.Request) -> str:
    res = request.resource
    assert res is not None
    return f"{res.group}/{res.version}" if res.group else str(res.version)


def _error(code: int, reason: str, message: str) -> aiohttp.web.Response:
    return aiohttp.web.json_response(
        {
            "apiVersion": "v1",
            "kind": "Status",
            "status": "Failure",
            "code": code,
            "reason": reason,
            "message": message,
        },
        status=code,
    )


@attrs.define(kw_only=True)
class ResourceType:
    """What the emulator knows about one resource beyond discovery."""

    kind: str
    namespaced: bool
    subresources: set[str]
    schema: Mapping[str, Any] | None = None
    replicas_path: str = ".spec.replicas"


@attrs.define(kw_only=True)
class KubeEmu(kmock.KubernetesScaffold):
    """The emulator; serve it with `kmock.Server(emu)` (see `conftest.cluster`)."""

    pod_termination_seconds: float | None = None  # None: pods vanish at once when deleted
    history_size: int = 5000  # watch events kept for resuming from a resourceVersion

    objects: dict[Key, dict[str, Any]] = attrs.field(factory=dict, init=False)
    deleted: list[dict[str, Any]] = attrs.field(factory=list, init=False)  # last states, in order
    delete_requests: list[Key] = attrs.field(factory=list, init=False)  # first DELETE of each
    types: dict[str, ResourceType] = attrs.field(factory=dict, init=False)
    _rv: Any = attrs.field(factory=lambda: itertools.count(1), init=False)
    _last_rv: int = attrs.field(default=0, init=False)
    _history: list[tuple[int, str, dict[str, Any]]] = attrs.field(factory=list, init=False)
    _watchers: dict[str, set[asyncio.Queue[dict[str, Any]]]] = attrs.field(factory=dict, init=False)
    _builtin_payloads: int = attrs.field(default=0, init=False)
    _tasks: set[asyncio.Task[None]] = attrs.field(factory=set, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for gv, plural, kind, namespaced, subs in BUILTINS:
            self.declare(gv, plural, kind, namespaced, subs)
        self._builtin_payloads = len(self._payloads)

    # --- declarations
    def declare(
        self,
        gv: str,
        plural: str,
        kind: str,
        namespaced: bool = True,
        subresources: set[str] | None = None,
        **extra: Any,
    ) -> None:
        """Make a resource discoverable and storable."""
        subs = set(subresources or ())
        self.resources[f"{gv}/{plural}"] = kmock.ResourceInfo(
            kind=kind,
            singular=kind.lower(),
            namespaced=namespaced,
            verbs=VERBS,
            subresources=subs,
            shortnames=set(extra.pop("shortnames", ())),
        )
        self.types[f"{gv}/{plural}"] = ResourceType(
            kind=kind, namespaced=namespaced, subresources=subs, **extra
        )

    def register_crd(self, crd: Mapping[str, Any]) -> None:
        """Serve the resources of a CustomResourceDefinition manifest, with its defaults."""
        spec, names = crd["spec"], crd["spec"]["names"]
        for version in spec["versions"]:
            subs = version.get("subresources") or {}
            self.declare(
                f"{spec['group']}/{version['name']}",
                names["plural"],
                names["kind"],
                spec.get("scope", "Namespaced") == "Namespaced",
                set(subs),
                shortnames=names.get("shortNames", ()),
                schema=(version.get("schema") or {}).get("openAPIV3Schema"),
                replicas_path=(subs.get("scale") or {}).get("specReplicasPath", ".spec.replicas"),
            )

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
        return await self._serve(request, f"{_gv(request)}/{res.plural}")

    async def _serve(self, request: kmock.Request, path: str) -> aiohttp.web.StreamResponse:
        method, ns, name = request.method.value.upper(), request.namespace or "", request.name
        if method == "GET" and request.params.get("watch") in ("true", "1"):
            return await self._watch(request, path)
        if name is None:
            if method == "GET":
                return aiohttp.web.json_response(self._list(request, path))
            if method == "POST":
                return self._create(request, path, ns)
            return _error(405, "MethodNotAllowed", f"{method} on a collection")
        key: Key = (path, ns, name)
        if key not in self.objects:
            return _error(404, "NotFound", f"{path} {name!r} not found")
        if method == "GET":
            return aiohttp.web.json_response(self._view(key, request.subresource))
        if method in ("PATCH", "PUT"):
            return self._update(request, key, method)
        if method == "DELETE":
            return aiohttp.web.json_response(self._delete(key))
        return _error(405, "MethodNotAllowed", method)

    # --- reads
    def _view(self, key: Key, subresource: str | None) -> dict[str, Any]:
        obj = self.objects[key]
        if subresource != "scale":
            return obj
        meta = obj["metadata"]
        return {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion")},
            "spec": {"replicas": get_path(obj, self.types[key[0]].replicas_path)},
            "status": {
                "replicas": get_path(obj, ".status.replicas") or 0,
                "selector": get_path(obj, ".status.selector") or "",
            },
        }

    def _list(self, request: kmock.Request, path: str) -> dict[str, Any]:
        items = [
            o
            for (p, ns, _), o in self.objects.items()
            if p == path and self._matches(request, ns, o)
        ]
        return {
            "apiVersion": _gv(request),
            "kind": f"{self.types[path].kind}List",
            "metadata": {"resourceVersion": str(self._last_rv)},
            "items": items,
        }

    def _matches(self, request: kmock.Request, ns: str, obj: Mapping[str, Any]) -> bool:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        return (
            (not request.namespace or ns == request.namespace)
            and labels_match(labels, request.params.get("labelSelector"))
            and fields_match(obj, request.params.get("fieldSelector"))
        )

    async def _watch(self, request: kmock.Request, path: str) -> aiohttp.web.StreamResponse:
        assert request._raw_request is not None
        since = request.params.get("resourceVersion") or "0"
        timeout = float(request.params.get("timeoutSeconds") or 3600)
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        if since in ("", "0"):
            for (p, _ns, _), obj in list(self.objects.items()):
                if p == path:
                    queue.put_nowait({"type": "ADDED", "object": obj})
        else:
            for rv, p, event in self._history:
                if p == path and rv > int(since):
                    queue.put_nowait(event)
        self._watchers.setdefault(path, set()).add(queue)
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request._raw_request)
        try:
            async with asyncio.timeout(timeout):
                while True:
                    event = await queue.get()
                    obj = event["object"]
                    if self._matches(request, obj["metadata"].get("namespace", ""), obj):
                        await response.write(json.dumps(event).encode() + b"\n")
        except (TimeoutError, ConnectionError):
            pass
        finally:
            self._watchers[path].discard(queue)
        with contextlib.suppress(ConnectionError):
            await response.write_eof()
        return response

    # --- writes
    def _emit(self, path: str, kind: str, obj: dict[str, Any]) -> None:
        event = {"type": kind, "object": json.loads(json.dumps(obj))}
        self._history.append((int(obj["metadata"]["resourceVersion"]), path, event))
        del self._history[: -self.history_size]
        for queue in self._watchers.get(path, ()):
            queue.put_nowait(event)

    def _next_rv(self) -> str:
        self._last_rv = next(self._rv)
        return str(self._last_rv)

    def _create(self, request: kmock.Request, path: str, ns: str) -> aiohttp.web.Response:
        body = json.loads(request.body or b"{}")
        meta = body.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if not meta.get("name"):
            return _error(422, "Invalid", "metadata.name: Required value")
        key: Key = (path, ns, meta["name"])
        if key in self.objects:
            return _error(409, "AlreadyExists", f"{path} {meta['name']!r} already exists")
        rtype = self.types[path]
        if rtype.namespaced:
            meta["namespace"] = ns
        meta.update(
            uid=str(uuid.uuid4()),
            creationTimestamp=now_rfc3339(),
            generation=1,
            resourceVersion=self._next_rv(),
        )
        if "status" in rtype.subresources and path != "v1/namespaces":
            body.pop("status", None)
        if rtype.schema is not None:
            apply_defaults(rtype.schema, body)
        self.objects[key] = body
        self._emit(path, "ADDED", body)
        if path == "apiextensions.k8s.io/v1/customresourcedefinitions":
            self.register_crd(body)
        return aiohttp.web.json_response(body, status=201)

    def _update(self, request: kmock.Request, key: Key, method: str) -> aiohttp.web.Response:
        current, rtype, sub = self.objects[key], self.types[key[0]], request.subresource
        patch = json.loads(request.body or b"null")
        ctype = {k.lower(): v for k, v in request.headers.items()}.get("content-type", "")
        try:
            if method == "PUT":
                want_rv = (patch.get("metadata") or {}).get("resourceVersion")
                new = patch if sub is None else merge_patch(current, patch)
            elif isinstance(patch, list) or "json-patch" in ctype:
                want_rv, new = None, jsonpatch.apply_patch(current, patch)
            elif "apply-patch" in ctype:
                return _error(415, "UnsupportedMediaType", "server-side apply is not emulated")
            else:
                want_rv = (patch.get("metadata") or {}).get("resourceVersion")
                new = merge_patch(current, patch)
        except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
            return _error(422, "Invalid", f"the server rejected our request: {exc}")
        if want_rv and want_rv != current["metadata"]["resourceVersion"]:
            return _error(
                409,
                "Conflict",
                "the object has been modified; please apply your "
                "changes to the latest version and try again",
            )
        if sub == "scale":
            replicas = get_path(patch, ".spec.replicas")
            new = json.loads(json.dumps(current))
            set_path(new, rtype.replicas_path, replicas)
        elif sub == "status":
            new = {**current, "status": new.get("status")}
        elif "status" in rtype.subresources and key[0] != "v1/namespaces":
            new = {**new, "status": current.get("status")}
            new = {k: v for k, v in new.items() if v is not None or k != "status"}
        meta = new.setdefault("metadata", {})
        for field in ("uid", "creationTimestamp", "namespace", "name", "deletionTimestamp"):
            if field in current["metadata"]:
                meta[field] = current["metadata"][field]
        generation = int(current["metadata"].get("generation") or 1)
        meta["generation"] = generation + (new.get("spec") != current.get("spec"))
        if rtype.schema is not None:
            apply_defaults(rtype.schema, new)
        meta["resourceVersion"] = self._next_rv()
        self.objects[key] = new
        self._emit(key[0], "MODIFIED", new)
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            self._remove(key)
        return aiohttp.web.json_response(self._view(key, sub) if key in self.objects else new)

    def _delete(self, key: Key) -> dict[str, Any]:
        obj, meta = self.objects[key], self.objects[key]["metadata"]
        if meta.get("deletionTimestamp"):
            return obj
        self.delete_requests.append(key)
        linger = key[0] == "v1/pods" and self.pod_termination_seconds is not None
        if meta.get("finalizers") or linger:
            meta.update(deletionTimestamp=now_rfc3339(), resourceVersion=self._next_rv())
            self._emit(key[0], "MODIFIED", obj)
            if linger and not meta.get("finalizers"):
                self._later(self.pod_termination_seconds or 0.0, key, meta["uid"])
            return obj
        self._remove(key)
        return obj

    def _later(self, delay: float, key: Key, uid: str) -> None:
        async def finish() -> None:
            await asyncio.sleep(delay)
            if key in self.objects and self.objects[key]["metadata"]["uid"] == uid:
                self._remove(key)

        task = asyncio.get_running_loop().create_task(finish())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _remove(self, key: Key) -> None:
        obj = self.objects.pop(key)
        obj["metadata"]["resourceVersion"] = self._next_rv()
        self.deleted.append(obj)
        self._emit(key[0], "DELETED", obj)
        uid = obj["metadata"]["uid"]  # garbage collection of dependents (background policy)
        for dep_key, dep in list(self.objects.items()):
            owners = dep["metadata"].get("ownerReferences") or []
            if dep_key in self.objects and any(o.get("uid") == uid for o in owners):
                self._delete(dep_key)

    async def _serve_version(self, request: kmock.Request) -> Any:
        doc = await super()._serve_version(request)
        if request.resource is not None and request.resource.group == "":
            doc["groupVersion"] = "v1"  # kmock writes "/v1", which clients reject
        for entry in doc.get("resources", []):
            if "/" in entry["name"]:
                entry.update(shortNames=[], categories=[], verbs=["get", "patch", "update"])
        return doc

    async def __aexit__(self, *exc: Any) -> None:
        for task in list(self._tasks):
            task.cancel()
        await super().__aexit__(*exc)
