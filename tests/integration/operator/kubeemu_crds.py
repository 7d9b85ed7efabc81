"""CustomResourceDefinitions as the API server's apiextensions controllers handle them.

`CrdControllers` is mixed into `kubeemu.KubeEmu`. A kind that no established CRD defines is not
served: a request for it (and for a group or version nothing serves) gets the real server's
`404 NotFound: the server could not find the requested resource` (`kubeemu_discovery`), and
discovery does not list it, so kubectl says `ensure CRDs are installed first`.

A CRD created through the API gets `status.acceptedNames`, `storedVersions` and the conditions
`NamesAccepted` and `Established` (True, with the real controllers' reasons), and its kind is
served from then on. The create answers the CRD as the real server does, before any of that
(`conditions: null`, empty `acceptedNames`); the emulator establishes it right after (a MODIFIED
event) by default, or, with `KubeEmu(crd_establish_seconds=S)`, S seconds later, which makes
the window the real server has observable: `kubectl apply -f` of one file with a CRD and an
object of its kind fails in it. (The real server serves a kind from NamesAccepted on and lists it
in discovery from Established on; the emulator sets both at once.) The create refuses, with the
real server's 422, a name other than `<plural>.<group>` and a schema whose root `metadata`
says anything but `type: object` and `name`/`generateName` properties (`root_metadata_errors`);
it defaults `spec.conversion` and the names' `singular` and `listKind`. Changing a CRD's spec
re-registers its kind (schema, printer columns, subresources). `KubeEmu.register_crd` serves a
kind without any CRD object, for tests that need no CRD lifecycle.

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
from kubeemu_schema import FieldError, invalid

Key = tuple[str, str, str]  # as in kubeemu_lifecycle
CRDS = "apiextensions.k8s.io/v1/customresourcedefinitions"
CLEANUP = "customresourcecleanup.apiextensions.k8s.io"


def root_metadata_errors(versions: list[dict[str, Any]]) -> list[FieldError]:
    """What the real server refuses on a schema's root `metadata`: anything but `type: object`
    and `properties` of `name` and `generateName` (it is ObjectMeta, implicitly specified)."""
    schemas = [((v.get("schema") or {}).get("openAPIV3Schema") or {}) for v in versions]
    shared = len({repr(s) for s in schemas}) <= 1
    errors = []
    for i, schema in enumerate(schemas[:1] if shared else schemas):
        meta = (schema.get("properties") or {}).get("metadata")
        if meta is None:
            continue
        extra = set(meta) - {"type", "properties"} or meta.get("type") not in (None, "object")
        props = set(meta.get("properties") or {}) - {"name", "generateName"}
        if extra or props:
            where = "spec.validation" if shared else f"spec.versions[{i}].schema"
            why = (
                "must not specify anything other than name and generateName, but metadata is "
                "implicitly specified"
            )
            field = f"{where}.openAPIV3Schema.properties[metadata]"
            errors.append(FieldError("Forbidden", field, detail=why))
    return errors


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

    def _crd_check(self, crd: dict[str, Any]) -> None:
        """The real server's checks of a new CRD (422), and its spec's defaults."""
        spec = crd.get("spec") or {}
        names = spec.get("names") or {}
        name = str(crd["metadata"].get("name") or "")
        errors = []
        if name != f"{names.get('plural')}.{spec.get('group')}":
            why = 'must be spec.names.plural+"."+spec.group'
            errors.append(FieldError("Invalid", "metadata.name", name, why))
        errors += root_metadata_errors(spec.get("versions") or [])
        if errors:
            details = {"group": "apiextensions.k8s.io", "kind": "CustomResourceDefinition"}
            raise invalid("CustomResourceDefinition.apiextensions.k8s.io", name, errors, details)
        if isinstance(names.get("kind"), str):
            names.setdefault("singular", names["kind"].lower())
            names.setdefault("listKind", f"{names['kind']}List")
        spec.setdefault("conversion", {"strategy": "None"})

    def _crd_created(self, crd: dict[str, Any]) -> None:
        """A new CRD's status as the create answers it: nothing accepted or established yet."""
        spec = crd.get("spec") or {}
        crd["status"] = {
            "conditions": None,
            "acceptedNames": {"plural": "", "kind": ""},
            "storedVersions": [v["name"] for v in spec.get("versions") or [] if v.get("storage")],
        }

    def _crd_establish_soon(self, key: Key) -> None:
        """The apiextensions controllers' work on a new CRD: at once (after the create's answer),
        or `crd_establish_seconds` later."""
        uid = self.objects[key]["metadata"]["uid"]

        def establish() -> None:
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

        if self.crd_establish_seconds <= 0:
            establish()
            return

        async def later() -> None:
            await asyncio.sleep(self.crd_establish_seconds)
            establish()

        task = asyncio.get_running_loop().create_task(later())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _establish(self, crd: dict[str, Any]) -> None:
        """Accept a CRD's names, mark it Established, and serve its kind."""
        names = dict(crd["spec"]["names"])
        names.setdefault("singular", names["kind"].lower())
        names.setdefault("listKind", f"{names['kind']}List")
        crd.setdefault("status", {})["acceptedNames"] = names
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
