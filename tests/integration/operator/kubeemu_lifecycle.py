"""Object lifecycle of the Kubernetes emulator: writes' bookkeeping, deletion, garbage collection.

`Lifecycle` is mixed into `kubeemu.KubeEmu`, which holds the fields it declares. Deletion follows
the API server: finalizers hold an object (with `deletionTimestamp` set and
`deletionGracePeriodSeconds: 0`) until they are removed; DeleteOptions' preconditions are
checked (409 on a mismatch); a second DELETE of a terminating object may only shorten its grace
period; setting `deletionTimestamp` bumps `metadata.generation`. Pods, in the modes `KubeEmu`'s
docstring describes, linger for `pod_termination_seconds` or until the kubelet's final
`gracePeriodSeconds=0` DELETE. Garbage collection, by `propagationPolicy`:
- Background (the default): removing an object deletes its dependents (ownerReferences to its
  uid), gracefully for pods;
- Orphan: removing it strips the reference from its dependents instead;
- Foreground: the owner gets the `foregroundDeletion` finalizer and `deletionTimestamp`, its
  dependents are deleted at once (those with `blockOwnerDeletion` that own objects themselves in
  the foreground too), and the finalizer goes once no dependent with `blockOwnerDeletion: true`
  is left (dependents without it do not hold the owner); then the owner goes, unless other
  finalizers hold it.
A CRD's deletion is `kubeemu_crds`'s.
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
import json
from collections.abc import Callable, Mapping
from typing import Any

from kubeemu_crds import CRDS
from kubeemu_discovery import ResourceType
from kubeemu_model import get_path
from kubeemu_request import DeleteOptions, conflict
from kubeemu_table import parse_time
from kubeemu_watch import EventLog

Key = tuple[str, str, str]  # (resource path "group/version/plural", namespace or "", name)
FOREGROUND = "foregroundDeletion"  # the finalizer of an owner deleted with Foreground
FOREGROUND_POLICY = {True: "Foreground", False: "Background"}


def rfc3339(epoch: float) -> str:
    """Epoch seconds as the API server writes timestamps."""
    stamp = datetime.datetime.fromtimestamp(epoch, datetime.timezone.utc)
    return stamp.strftime("%Y-%m-%dT%H:%M:%SZ")


class Lifecycle:
    """Deletion and garbage collection over `KubeEmu`'s store (see the module docstring)."""

    # KubeEmu's fields (attrs ignores annotations of a plain base class)
    pod_termination_seconds: float | None
    kubelet_finalizes_pods: bool | None
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
    _crd_deleting: Callable[[dict[str, Any]], None]
    _crd_clean_up: Callable[[str], None]
    _crd_release: Callable[[str], None]
    _crd_terminating: Callable[[str], bool]
    unregister_crd: Callable[[str], list[str]]

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

    def _kubelet_mode(self) -> bool:
        """Whether scheduled pods wait for the kubelet's final DELETE (see `KubeEmu`)."""
        if self.kubelet_finalizes_pods is None:
            return self.pod_termination_seconds is None
        return self.kubelet_finalizes_pods

    def _grace_seconds(self, key: Key, options: DeleteOptions) -> int:
        """How long a first DELETE lets the kubelet stop the pod (0: not graceful)."""
        if key[0] != "v1/pods" or not self._kubelet_mode():
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
        if not meta.get("deletionTimestamp"):
            if key[0] == CRDS:
                self._crd_deleting(obj)
            if opts.propagation_policy == "Foreground" and FOREGROUND not in (
                meta.get("finalizers") or []
            ):
                meta["finalizers"] = [*(meta.get("finalizers") or []), FOREGROUND]
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
            and not self._kubelet_mode()
        )
        if grace or meta.get("finalizers") or linger:
            now = datetime.datetime.now(datetime.timezone.utc).timestamp()
            meta.update(deletionTimestamp=rfc3339(now + grace), resourceVersion=self._next_rv())
            if meta.get("generation"):  # the API server's signal to controllers, as a spec change
                meta["generation"] = int(meta["generation"]) + 1
            if not linger:
                meta["deletionGracePeriodSeconds"] = grace
            self._emit(key[0], "MODIFIED", obj)
            answer: dict[str, Any] = json.loads(json.dumps(obj))  # the state this DELETE left
            if linger and not meta.get("finalizers"):
                self._later(self.pod_termination_seconds or 0.0, key, meta["uid"])
            if key[0] == CRDS:
                self._crd_clean_up(key[2])
            if FOREGROUND in (meta.get("finalizers") or []):
                self._delete_dependents(meta["uid"])
                self._foreground_release(meta["uid"])
            return answer
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

    def _dependents(self, uid: str, blocking: bool = False) -> list[Key]:
        """Objects with an ownerReference to `uid` (only those with blockOwnerDeletion)."""
        return [
            dep_key
            for dep_key, dep in list(self.objects.items())
            if any(
                o.get("uid") == uid and (o.get("blockOwnerDeletion") or not blocking)
                for o in dep["metadata"].get("ownerReferences") or []
            )
        ]

    def _delete_dependents(self, uid: str) -> None:
        """Foreground deletion: delete an owner's dependents; blocking ones with dependents of
        their own in the foreground too, as the garbage collector does."""
        blocking = set(self._dependents(uid, blocking=True))
        for dep_key in self._dependents(uid):
            dep = self.objects.get(dep_key)
            if dep is None or dep["metadata"].get("deletionTimestamp"):
                continue
            deep = dep_key in blocking and self._dependents(dep["metadata"]["uid"])
            self._delete(dep_key, DeleteOptions(propagation_policy=FOREGROUND_POLICY[bool(deep)]))

    def _foreground_release(self, uid: str) -> None:
        """Drop the foregroundDeletion finalizer of the owner `uid` once no dependent with
        blockOwnerDeletion is left; the owner goes then unless other finalizers hold it."""
        key = next((k for k, o in list(self.objects.items()) if o["metadata"]["uid"] == uid), None)
        if key is None or self._dependents(uid, blocking=True):
            return
        meta = self.objects[key]["metadata"]
        if FOREGROUND not in (meta.get("finalizers") or []):
            return
        meta["finalizers"] = [f for f in meta["finalizers"] if f != FOREGROUND]
        if not meta["finalizers"]:
            del meta["finalizers"]
        meta["resourceVersion"] = self._next_rv()
        self._emit(key[0], "MODIFIED", self.objects[key])
        if self._can_go(meta):
            self._remove(key)

    def _remove(self, key: Key) -> None:
        """Drop an object from the store (DELETED event) and collect its dependents."""
        obj = self.objects.pop(key)
        obj["metadata"]["resourceVersion"] = self._next_rv()
        self.deleted.append(obj)
        self._emit(key[0], "DELETED", obj)
        if key[0] == CRDS:
            self.unregister_crd(key[2])
        crd = self.types[key[0]].crd if key[0] in self.types else None
        if crd is not None and self._crd_terminating(crd):
            self._crd_release(crd)
        for owner in obj["metadata"].get("ownerReferences") or []:
            if owner.get("blockOwnerDeletion") and owner.get("uid"):
                self._foreground_release(owner["uid"])
        uid = obj["metadata"]["uid"]  # garbage collection of dependents
        self._uids.discard(uid)
        orphan = uid in self._orphaning
        self._orphaning.discard(uid)
        for dep_key in self._dependents(uid):
            dep = self.objects.get(dep_key)
            if dep is None:
                continue
            owners = dep["metadata"].get("ownerReferences") or []
            if not orphan:
                self._delete(dep_key)
                continue
            dep = json.loads(json.dumps(dep))
            dep["metadata"]["ownerReferences"] = [o for o in owners if o.get("uid") != uid]
            if not dep["metadata"]["ownerReferences"]:  # an empty list is not stored
                del dep["metadata"]["ownerReferences"]
            dep["metadata"]["resourceVersion"] = self._next_rv()
            self.objects[dep_key] = dep
            self._emit(dep_key[0], "MODIFIED", dep)
