"""Reads of the Kubernetes emulator: objects, subresource views, lists, Tables and watches.

`Reads` is mixed into `kubeemu.KubeEmu`. As the real server: a list of a built-in kind carries
its items without `apiVersion` and `kind` (a custom resource list keeps them, and has
`metadata.continue`); a watch starts from a resourceVersion (replaying the history, 410 past it),
from "0" or with `sendInitialEvents=true` (the current objects, then the `initial-events-end`
BOOKMARK), and with `allowWatchBookmarks=true` gets a BOOKMARK after `bookmark_seconds` without
an event (60 s by default: about what the real server does).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import aiohttp.web
import kmock
from kubeemu_discovery import ResourceType
from kubeemu_model import fields_match, labels_match
from kubeemu_printers import printer_for
from kubeemu_request import StatusError
from kubeemu_table import to_table
from kubeemu_watch import Event, EventLog, stream
from kubeemu_writes import scale_view

Key = tuple[str, str, str]  # as in kubeemu_lifecycle


def _gv(request: kmock.Request) -> str:
    res = request.resource
    assert res is not None
    return f"{res.group}/{res.version}" if res.group else str(res.version)


class Reads:
    """GET, LIST and WATCH over `KubeEmu`'s store."""

    # KubeEmu's fields; annotations only, nothing shadowed
    objects: dict[Key, dict[str, Any]]
    types: dict[str, ResourceType]
    bookmark_seconds: float
    _last_rv: int
    _events: EventLog

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
        meta: dict[str, Any] = {"resourceVersion": str(self._last_rv)}
        if self.types[path].crd is None:  # built-in kinds: items without apiVersion and kind
            items = [{k: v for k, v in o.items() if k not in ("apiVersion", "kind")} for o in items]
        else:
            meta = {"continue": "", **meta}
        return {
            "apiVersion": _gv(request),
            "kind": f"{self.types[path].kind}List",
            "metadata": meta,
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
