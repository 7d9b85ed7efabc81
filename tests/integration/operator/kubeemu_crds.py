"""CustomResourceDefinitions as the API server's apiextensions controllers handle them.

`CrdControllers` is mixed into `kubeemu.KubeEmu`. A kind that no established CRD defines is not
served: a request for it (and for a group or version nothing serves) gets the real server's
`404 NotFound: the server could not find the requested resource` (`kubeemu_discovery`), and
discovery does not list it, so kubectl says `ensure CRDs are installed first`.

A CRD created through the API gets `status.acceptedNames`, `storedVersions` and the conditions
`NamesAccepted` and `Established` (True, with the real controllers' reasons), and its kind is
served from then on: at once by default (in the create itself, so no extra event), or, with
`KubeEmu(crd_establish_seconds=S)`, S seconds later (a MODIFIED event of the CRD), which makes
the window the real server has observable: `kubectl apply -f` of one file with a CRD and an
object of its kind fails in it. (The real server serves a kind from NamesAccepted on and lists it
in discovery from Established on; the emulator sets both at once.) The CRD's name must be
`<plural>.<group>` (422 otherwise). Changing a CRD's spec re-registers its kind (schema, printer
columns, subresources). `KubeEmu.register_crd` serves a kind without any CRD object, for tests
that need no CRD lifecycle.

Deleting a CRD: it gets the `customresourcecleanup.apiextensions.k8s.io` finalizer,
`deletionTimestamp` and a `Terminating=True` condition; creating objects of its kind is refused
(405 MethodNotAllowed); every object of its kind is deleted (their own finalizers hold them);
once none is left the finalizer goes, then the CRD, and the kind is no longer served.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable, Mapping
from typing import Any

from kubeemu_discovery import ResourceType
from kubeemu_model import now_rfc3339
from kubeemu_request import StatusError

Key = tuple[str, str, str]  # as in kubeemu_lifecycle
CRDS = "apiextensions.k8s.io/v1/customresourcedefinitions"
CLEANUP = "customresourcecleanup.apiextensions.k8s.io"


def condition(kind: str, reason: str, message: str) -> dict[str, str]:
    """A True CRD condition, as the apiextensions controllers write it."""
    return {
        "type": kind,
        "status": "True",
        "lastTransitionTime": now_rfc3339(),
        "reason": reason,
        "message": message,
    }


def is_true(crd: Mapping[str, Any], kind: str) -> bool:
    """Whether a CRD's condition of that type is True."""
    conditions = (crd.get("status") or {}).get("conditions") or []
    return any(c.get("type") == kind and c.get("status") == "True" for c in conditions)


class CrdControllers:
    """CRD establishment and clean-up over `KubeEmu`'s store (see the module docstring)."""

    # KubeEmu's fields and methods; annotations only, nothing shadowed
    crd_establish_seconds: float
    objects: dict[Key, dict[str, Any]]
    types: dict[str, ResourceType]
    _tasks: set[asyncio.Task[None]]
    _next_rv: Callable[[], str]
    _emit: Callable[[str, str, dict[str, Any]], None]
    _delete: Callable[..., dict[str, Any]]
    _remove: Callable[[Key], None]
    _can_go: Callable[[Mapping[str, Any]], bool]
    register_crd: Callable[[Mapping[str, Any]], None]
    unregister_crd: Callable[[str], list[str]]

    def _crd_created(self, crd: dict[str, Any]) -> None:
        """Fill a new CRD's status (before it is stored); serve it now or later."""
        spec = crd.get("spec") or {}
        names = spec.get("names") or {}
        expected = f"{names.get('plural')}.{spec.get('group')}"
        if crd["metadata"]["name"] != expected:
            raise StatusError(
                422,
                "Invalid",
                f'CustomResourceDefinition.apiextensions.k8s.io "{crd["metadata"]["name"]}" is '
                f'invalid: metadata.name: Invalid value: "{crd["metadata"]["name"]}": must be '
                'spec.names.plural+"."+spec.group',
            )
        crd["status"] = {
            "acceptedNames": {"plural": "", "kind": ""},
            "conditions": [],
            "storedVersions": [v["name"] for v in spec.get("versions") or [] if v.get("storage")],
        }
        if self.crd_establish_seconds <= 0:
            self._establish(crd)
            return
        name, uid = crd["metadata"]["name"], crd["metadata"]["uid"]

        async def later() -> None:
            await asyncio.sleep(self.crd_establish_seconds)
            key: Key = (CRDS, "", name)
            current = self.objects.get(key)
            if current is None or current["metadata"]["uid"] != uid:
                return
            if current["metadata"].get("deletionTimestamp"):
                return
            new = copy.deepcopy(current)
            self._establish(new)
            new["metadata"]["resourceVersion"] = self._next_rv()
            self.objects[key] = new
            self._emit(CRDS, "MODIFIED", new)

        task = asyncio.get_running_loop().create_task(later())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _establish(self, crd: dict[str, Any]) -> None:
        """Accept a CRD's names, mark it Established, and serve its kind."""
        names = dict(crd["spec"]["names"])
        names.setdefault("singular", names["kind"].lower())
        names.setdefault("listKind", f"{names['kind']}List")
        crd["status"]["acceptedNames"] = names
        accepted = "the initial names have been accepted"
        crd["status"]["conditions"] = [
            condition("NamesAccepted", "NoConflicts", "no conflicts found"),
            condition("Established", "InitialNamesAccepted", accepted),
        ]
        self.register_crd(crd)

    def _crd_updated(self, crd: dict[str, Any]) -> None:
        """Serve an established CRD's changed spec."""
        if is_true(crd, "Established") and not crd["metadata"].get("deletionTimestamp"):
            self.register_crd(crd)

    def _crd_terminating(self, name: str) -> bool:
        """Whether the CRD of that name is being deleted."""
        crd = self.objects.get((CRDS, "", name))
        return bool(crd and crd["metadata"].get("deletionTimestamp"))

    def _crd_deleting(self, crd: dict[str, Any]) -> None:
        """On a CRD's first DELETE, before it is marked: its clean-up finalizer and condition."""
        finalizers = crd["metadata"].setdefault("finalizers", [])
        if CLEANUP not in finalizers:
            finalizers.append(CLEANUP)
        conditions = (crd.setdefault("status", {}).get("conditions") or [])[:]
        why = "the object is being deleted"
        crd["status"]["conditions"] = [
            *(c for c in conditions if c.get("type") != "Terminating"),
            condition("Terminating", "InstanceDeletionInProgress", why),
        ]

    def _crd_clean_up(self, name: str) -> None:
        """Delete every object of a terminating CRD's kind, then release the CRD."""
        paths = {path for path, rtype in self.types.items() if rtype.crd == name}
        for key in [k for k in list(self.objects) if k[0] in paths]:
            if key in self.objects and not self.objects[key]["metadata"].get("deletionTimestamp"):
                self._delete(key)
        self._crd_release(name)

    def _crd_release(self, name: str) -> None:
        """Drop a terminating CRD's clean-up finalizer once no object of its kind is left."""
        key: Key = (CRDS, "", name)
        crd = self.objects.get(key)
        if crd is None or CLEANUP not in (crd["metadata"].get("finalizers") or []):
            return
        paths = {path for path, rtype in self.types.items() if rtype.crd == name}
        if any(k[0] in paths for k in list(self.objects)):
            return
        crd = copy.deepcopy(crd)
        crd["metadata"]["finalizers"] = [f for f in crd["metadata"]["finalizers"] if f != CLEANUP]
        if not crd["metadata"]["finalizers"]:
            del crd["metadata"]["finalizers"]
        crd["metadata"]["resourceVersion"] = self._next_rv()
        self.objects[key] = crd
        self._emit(CRDS, "MODIFIED", crd)
        if self._can_go(crd["metadata"]):
            self._remove(key)
