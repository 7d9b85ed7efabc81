"""Update rules of the Kubernetes emulator: patch bodies, subresources, what an update changes.

Used by `kubeemu.KubeEmu._update`. They follow the API server:
- PATCH bodies: JSON patch (RFC 6902, a failed `test` is 422), JSON merge patch (RFC 7386) and
  strategic merge patch; custom resources refuse strategic merge with 415, as the real server
  does (they have no Go struct tags to merge by), so clients such as `kubectl patch` must say
  `--type merge`;
- PUT of a custom resource without `metadata.resourceVersion` is 422 (custom resources do not
  allow unconditional updates); a stale one is 409 Conflict, for PUT and PATCH alike;
- every write of a custom resource is pruned, defaulted and validated (`kubeemu_schema`), a
  built-in kind's gets its few emulated defaults and the name check; empty `labels`,
  `annotations`, `finalizers` and `ownerReferences` are not stored (Go's omitempty);
- the status subresource writes only `status` (metadata and spec changes are ignored), and a
  write of the object itself keeps the stored `status` (for kinds with a status subresource);
- the scale subresource reads an `autoscaling/v1 Scale` (`spec.replicas` from the CRD's
  `specReplicasPath`, `status.replicas` and `status.selector` from `.status.replicas` and
  `.status.selector`, the paths corefleet's CRD declares; a Deployment's selector from its
  `spec.selector`) and writes only the replicas (checked as the object's field);
- no finalizer may be added to an object that is being deleted (422 Forbidden);
- `metadata.generation` of a custom resource grows by one when anything but metadata and status
  changes (with a status subresource; without one a status change counts too); of a built-in
  kind that keeps one (`GENERATION_KINDS`: not ConfigMaps, Secrets, Services, ...), when its
  spec changes.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import jsonpatch
import kmock
from kubeemu_discovery import ResourceType
from kubeemu_model import apply_kind_defaults, get_path, merge_patch, set_path, strategic_merge
from kubeemu_request import (
    StatusError,
    check_content_type,
    conflict,
    group_of,
    json_body,
    kind_label,
)
from kubeemu_schema import FieldError, custom_errors, invalid, name_errors, prune

GENERATION_KINDS = {
    "v1/pods",
    "apps/v1/deployments",
    "policy/v1/poddisruptionbudgets",
    "networking.k8s.io/v1/networkpolicies",
    "apiextensions.k8s.io/v1/customresourcedefinitions",
}
OMITTED_WHEN_EMPTY = ("labels", "annotations", "finalizers", "ownerReferences")

STALE = (
    "the object has been modified; please apply your changes to the latest version and try again"
)
CUSTOM_PATCH_TYPES = (
    "application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml"
)


def _details(path: str, kind: str) -> dict[str, str]:
    group = group_of(path)
    return {**({"group": group} if group else {}), "kind": kind}


def tracks_generation(path: str, rtype: ResourceType) -> bool:
    """Whether objects of this kind have a `metadata.generation`."""
    return rtype.crd is not None or path in GENERATION_KINDS


def checked(path: str, rtype: ResourceType, obj: dict[str, Any]) -> dict[str, Any]:
    """An object as the server stores it after a write: pruned and defaulted; 422 if invalid."""
    if rtype.crd is not None:
        obj = prune(rtype.schema, obj, root=True)
    obj.setdefault("metadata", {})
    apply_kind_defaults(rtype.schema, rtype.defaults, obj)
    meta = obj["metadata"]
    for field in OMITTED_WHEN_EMPTY:
        if field in meta and not meta[field]:
            del meta[field]
    if rtype.crd is not None:
        replicas = rtype.replicas_path if "scale" in rtype.subresources else None
        errors = custom_errors(rtype.schema, obj, replicas)
    else:
        errors = name_errors(meta)
    if errors:
        name = str(meta.get("name") or "")
        raise invalid(kind_label(path, rtype.kind), name, errors, _details(path, rtype.kind))
    return obj


def patched(
    request: kmock.Request,
    current: dict[str, Any],
    method: str,
    rtype: ResourceType,
    path: str = "",
) -> tuple[Any, str | None]:
    """(the new object, the resourceVersion the writer expects or None)."""
    ctype = check_content_type(request.headers)
    patch = json_body(request.body, None)
    is_json_patch = "json-patch" in ctype or (method == "PATCH" and isinstance(patch, list))
    if method == "PATCH" and "strategic" in ctype and rtype.crd is not None:
        raise StatusError(
            415,
            "UnsupportedMediaType",
            "the body of the request was in an unknown format - accepted media types include: "
            + CUSTOM_PATCH_TYPES,
        )
    if not isinstance(patch, list if is_json_patch else dict):
        raise StatusError(400, "BadRequest", f"a {ctype or 'JSON'} body of the wrong shape")
    if is_json_patch:
        try:
            return jsonpatch.apply_patch(current, patch), None
        except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
            why = "the server rejected our request due to an error in our request"
            raise StatusError(422, "Invalid", why, {}) from exc
    assert isinstance(patch, dict)
    want_rv = (patch.get("metadata") or {}).get("resourceVersion")
    if method == "PUT":
        if not want_rv and rtype.crd is not None:
            name = str((current.get("metadata") or {}).get("name"))
            error = FieldError(
                "Invalid", "metadata.resourceVersion", 0, "must be specified for an update"
            )
            plural = path.split("/")[-1]
            label = f"{plural}.{group_of(path)}"
            raise invalid(label, name, [error], _details(path, plural))
        return (patch if request.subresource is None else merge_patch(current, patch)), want_rv
    merge = strategic_merge if "strategic" in ctype else merge_patch
    return merge(current, patch), want_rv


def check_resource_version(path: str, name: str, current: Mapping[str, Any], want: Any) -> None:
    """409 Conflict when the writer's resourceVersion is not the stored one."""
    if want and want != current["metadata"]["resourceVersion"]:
        raise conflict(path, name, STALE)


def check_finalizers(
    path: str, rtype: ResourceType, current: Mapping[str, Any], new: Mapping[str, Any]
) -> None:
    """422 when an update adds finalizers to an object that is being deleted."""
    if not (current.get("metadata") or {}).get("deletionTimestamp"):
        return
    before = set((current.get("metadata") or {}).get("finalizers") or [])
    added = [f for f in (new.get("metadata") or {}).get("finalizers") or [] if f not in before]
    if added:
        found = ", ".join(f'"{f}"' for f in added)
        why = (
            "no new finalizers can be added if the object is being deleted, found new "
            f"finalizers []string{{{found}}}"
        )
        error = FieldError("Forbidden", "metadata.finalizers", detail=why)
        name = str(current["metadata"].get("name"))
        # The real server checks it twice (the generic update and the kind's): two causes.
        errors = [error, error]
        raise invalid(kind_label(path, rtype.kind), name, errors, _details(path, rtype.kind))


def next_generation(rtype: ResourceType, current: Mapping[str, Any], new: Mapping[str, Any]) -> int:
    """The generation after an update: +1 when anything but metadata (and status) changed."""
    generation = int((current.get("metadata") or {}).get("generation") or 1)
    if rtype.crd is None:  # built-in kinds here: their spec
        return generation + (current.get("spec") != new.get("spec"))
    ignored = {"metadata", "status"} if "status" in rtype.subresources else {"metadata"}
    keys = (set(current) | set(new)) - ignored
    return generation + any(current.get(k) != new.get(k) for k in keys)


def scale_view(obj: Mapping[str, Any], rtype: ResourceType) -> dict[str, Any]:
    """The object's scale subresource."""
    meta = obj["metadata"]
    fields = ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
    status: dict[str, Any] = {"replicas": get_path(obj, ".status.replicas") or 0}
    if rtype.crd is None:  # a Deployment: its label selector
        labels = get_path(obj, ".spec.selector.matchLabels") or {}
        selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    else:
        selector = get_path(obj, ".status.selector") or ""
    if selector:
        status["selector"] = selector
    return {
        "apiVersion": "autoscaling/v1",
        "kind": "Scale",
        "metadata": {k: meta[k] for k in fields if k in meta},
        "spec": {"replicas": get_path(obj, rtype.replicas_path)},
        "status": status,
    }


def isolated(
    rtype: ResourceType, path: str, sub: str | None, current: dict[str, Any], new: dict[str, Any]
) -> dict[str, Any]:
    """What a write through `sub` (None: the object itself) may change of `current`."""
    if sub == "scale":
        replicas = get_path(new, ".spec.replicas")
        wrong = not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0
        if rtype.crd is None and wrong:  # a custom resource's is checked as its field
            error = FieldError(
                "Invalid", "spec.replicas", replicas, "must be greater than or equal to 0"
            )
            name = str(current["metadata"].get("name"))
            raise invalid("Scale.autoscaling", name, [error], _details("autoscaling/v1/x", "Scale"))
        new = copy.deepcopy(current)
        set_path(new, rtype.replicas_path, replicas)
        return new
    if sub == "status":
        return {**copy.deepcopy(current), "status": new.get("status")}
    if "status" in rtype.subresources and path != "v1/namespaces":
        new = {**new, "status": current.get("status")}
        return {k: v for k, v in new.items() if v is not None or k != "status"}
    return new
