"""Object lifecycle of the Kubernetes emulator: writes' bookkeeping, deletion, garbage collection.

`Lifecycle` is mixed into `kubeemu.KubeEmu`, which holds the fields it declares. Deletion follows
the API server: finalizers hold an object (with `deletionTimestamp` set and
`deletionGracePeriodSeconds: 0`) until they are removed; DeleteOptions' preconditions are
checked (409 on a mismatch); a second DELETE of a terminating object may only shorten its grace
period. Pods, in the modes `KubeEmu`'s docstring describes, linger for `pod_termination_seconds`
or until the kubelet's final `gracePeriodSeconds=0` DELETE. Removing an object deletes its
dependents (ownerReferences to its uid), gracefully for pods, unless it was deleted with
`propagationPolicy: Orphan`, which strips the reference from them instead.
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
import json
from collections.abc import Mapping
from typing import Any

from kubeemu_discovery import ResourceType
from kubeemu_model import get_path
from kubeemu_request import DeleteOptions, conflict
from kubeemu_table import parse_time
from kubeemu_watch import EventLog

Key = tuple[str, str, str]  # (resource path "group/version/plural", namespace or "", name)


def rfc3339(epoch: float) -> str:
    """Epoch seconds as the API server writes timestamps."""
    stamp = datetime.datetime.fromtimestamp(epoch, datetime.timezone.utc)
    return stamp.strftime("%Y-%m-%dT%H:%M:%SZ")


class Lifecycle:
    """Deletion and garbage collection over `KubeEmu`'s store (see the module docstring)."""

    # KubeEmu's fields (attrs ignores annotations of a plain base class)
    pod_termination_seconds: float | None
    kubelet_finalizes_pods: bool
    objects: dict[Key, dict[str, Any]]
    types: dict[str, ResourceType]
    deleted: list[dict[str, Any]]
    delete_requests: list[Key]
    _rv: itertools.count[int]
    _last_rv: int
    _events: EventLog
    _uids: set[str]
    _orphaning: set[str]
    _tasks: set[asyncio.Task[None]]

    def _emit(self, path: str, kind: str, obj: dict[str, Any]) -> None:
        """Record a watch event."""
        self._events.emit(path, kind, obj)

    def _next_rv(self) -> str:
        """The next resourceVersion (also the list resourceVersion from now on)."""
        self._last_rv = next(self._rv)
        return str(self._last_rv)

    @staticmethod
    def _can_go(meta: Mapping[str, Any]) -> bool:
        """Whether a terminating object has nothing left holding it."""
        return bool(
            meta.get("deletionTimestamp")
            and not meta.get("finalizers")
            and not meta.get("deletionGracePeriodSeconds")
        )

    def _grace_seconds(self, key: Key, options: DeleteOptions) -> int:
        """How long a first DELETE lets the kubelet stop the pod (0: not graceful)."""
        if key[0] != "v1/pods" or not self.kubelet_finalizes_pods:
            return 0
        pod = self.objects[key]
        if not get_path(pod, ".spec.nodeName"):
            return 0
        if get_path(pod, ".status.phase") in ("Succeeded", "Failed"):
            return 0
        seconds = options.grace_period_seconds
        if seconds is None:
            seconds = get_path(pod, ".spec.terminationGracePeriodSeconds")
        seconds = 30 if seconds is None else int(seconds)
        return 1 if seconds < 0 else seconds

    def _delete(self, key: Key, options: DeleteOptions | None = None) -> dict[str, Any]:
        """DELETE one object; returns it in its state after the request."""
        obj, opts = self.objects[key], options or DeleteOptions()
        meta = obj["metadata"]
        for field, expected in opts.preconditions.items():
            if expected is not None and meta.get(field) != expected:
                why = f"Precondition failed: {field} in precondition: {expected}, {field} in object meta: {meta.get(field)}"  # noqa: E501
                raise conflict(key[0], key[2], why)
        if opts.propagation_policy == "Orphan":
            self._orphaning.add(meta["uid"])
        if meta.get("deletionTimestamp"):
            pending, wanted = meta.get("deletionGracePeriodSeconds"), opts.grace_period_seconds
            if pending and wanted is not None and max(wanted, 0) < pending:  # only shortens
                deadline = (parse_time(meta["deletionTimestamp"]) or 0.0) - pending + max(wanted, 0)
                meta.update(
                    deletionTimestamp=rfc3339(deadline),
                    deletionGracePeriodSeconds=max(wanted, 0),
                    resourceVersion=self._next_rv(),
                )
                self._emit(key[0], "MODIFIED", obj)
                if self._can_go(meta):
                    self._remove(key)
            return obj
        self.delete_requests.append(key)
        grace = self._grace_seconds(key, opts)
        linger = (
            key[0] == "v1/pods"
            and self.pod_termination_seconds is not None
            and not self.kubelet_finalizes_pods
        )
        if grace or meta.get("finalizers") or linger:
            now = datetime.datetime.now(datetime.timezone.utc).timestamp()
            meta.update(deletionTimestamp=rfc3339(now + grace), resourceVersion=self._next_rv())
            if not linger:
                meta["deletionGracePeriodSeconds"] = grace
            self._emit(key[0], "MODIFIED", obj)
            if linger and not meta.get("finalizers"):
                self._later(self.pod_termination_seconds or 0.0, key, meta["uid"])
            return obj
        self._remove(key)
        return obj

    def _later(self, delay: float, key: Key, uid: str) -> None:
        """Remove the object after `delay` seconds unless it was replaced meanwhile."""

        async def finish() -> None:
            await asyncio.sleep(delay)
            if key in self.objects and self.objects[key]["metadata"]["uid"] == uid:
                self._remove(key)

        task = asyncio.get_running_loop().create_task(finish())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _remove(self, key: Key) -> None:
        """Drop an object from the store (DELETED event) and collect its dependents."""
        obj = self.objects.pop(key)
        obj["metadata"]["resourceVersion"] = self._next_rv()
        self.deleted.append(obj)
        self._emit(key[0], "DELETED", obj)
        uid = obj["metadata"]["uid"]  # garbage collection of dependents
        self._uids.discard(uid)
        orphan = uid in self._orphaning
        self._orphaning.discard(uid)
        for dep_key, dep in list(self.objects.items()):
            owners = dep["metadata"].get("ownerReferences") or []
            if dep_key not in self.objects or not any(o.get("uid") == uid for o in owners):
                continue
            if not orphan:
                self._delete(dep_key)
                continue
            dep = json.loads(json.dumps(dep))
            dep["metadata"]["ownerReferences"] = [o for o in owners if o.get("uid") != uid]
            dep["metadata"]["resourceVersion"] = self._next_rv()
            self.objects[dep_key] = dep
            self._emit(dep_key[0], "MODIFIED", dep)
