"""HTTP-level helpers of the Kubernetes emulator: Status errors, bodies, Accept, DeleteOptions.

Used by `kubeemu.py`. A handler raises `StatusError` for any request it refuses; the emulator
answers it as the API server does, with a `v1 Status` object (kubectl prints its `message` as
`Error from server (<reason>): <message>`). Messages follow the real server's wording where
clients or people read them, e.g. `inferenceengines.corefleet.dev "x" not found`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import aiohttp.web
import attrs

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
TABLES = ("v1", "v1beta1")  # meta.k8s.io Table versions served (the same document)
PROPAGATION_POLICIES = {"Background", "Foreground", "Orphan"}


class StatusError(Exception):
    """A refused request, answered as a `v1 Status` with the HTTP code."""

    def __init__(
        self, code: int, reason: str, message: str, details: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message
        self.details = None if details is None else dict(details)  # {}: shown empty

    def status(self) -> dict[str, Any]:
        """The `v1 Status` body."""
        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Status",
            "metadata": {},
            "status": "Failure",
            "code": self.code,
            "reason": self.reason,
            "message": self.message,
        }
        if self.details is not None:
            body["details"] = self.details
        return body

    def response(self) -> aiohttp.web.Response:
        """The HTTP answer."""
        return aiohttp.web.json_response(self.status(), status=self.code)


def resource_name(path: str) -> str:
    """How the API server names a resource in messages: `pods`, `deployments.apps`, ..."""
    parts = path.split("/")
    return parts[-1] if len(parts) == 2 else f"{parts[-1]}.{parts[0]}"


def group_of(path: str) -> str:
    """The API group of a resource path ("" for the core group)."""
    parts = path.split("/")
    return parts[0] if len(parts) == 3 else ""


def object_details(path: str, name: str, **extra: Any) -> dict[str, Any]:
    """A Status's `details` about one object: name, group (none for the core group), kind
    (the resource's plural, as the real server writes it)."""
    group = group_of(path)
    return {
        "name": name,
        **({"group": group} if group else {}),
        "kind": path.split("/")[-1],
        **extra,
    }


def kind_label(path: str, kind: str) -> str:
    """How a 422 names a kind: `ConfigMap`, `Deployment.apps`, `InferenceEngine.corefleet.dev`."""
    group = group_of(path)
    return f"{kind}.{group}" if group else kind


def not_found(path: str, name: str) -> StatusError:
    """404 for a missing object, worded like the real server."""
    details = object_details(path, name)
    return StatusError(404, "NotFound", f'{resource_name(path)} "{name}" not found', details)


def already_exists(path: str, name: str) -> StatusError:
    """409 AlreadyExists for a create of a taken name."""
    message = f'{resource_name(path)} "{name}" already exists'
    return StatusError(409, "AlreadyExists", message, object_details(path, name))


def conflict(path: str, name: str, why: str) -> StatusError:
    """409 Conflict on an object (stale resourceVersion, failed precondition, ...)."""
    return StatusError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {resource_name(path)} "{name}": {why}',
        object_details(path, name),
    )


def json_body(request_body: bytes, default: Any) -> Any:
    """The decoded JSON request body (`default` when empty); 400 when it is not JSON."""
    if not request_body.strip():
        return default
    try:
        return json.loads(request_body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise StatusError(400, "BadRequest", f"the request body is not valid JSON: {exc}") from exc


def check_content_type(headers: Mapping[str, str]) -> str:
    """The request's content type, lowercased; 415 for bodies the emulator cannot read."""
    ctype = _header(headers, "content-type").split(";")[0].strip().lower()
    if "protobuf" in ctype:
        raise StatusError(
            415,
            "UnsupportedMediaType",
            f"the emulator reads JSON bodies only, not {ctype} (kubectl create <generator> "
            "sends protobuf: write a manifest and use kubectl create -f or apply -f)",
        )
    if "apply-patch" in ctype:
        raise StatusError(
            415,
            "UnsupportedMediaType",
            "server-side apply is not emulated: use client-side kubectl apply",
        )
    if "yaml" in ctype:
        raise StatusError(415, "UnsupportedMediaType", f"{ctype} bodies are not emulated")
    return ctype


def check_not_dry_run(params: Mapping[str, str]) -> None:
    """400 for `dryRun=All`: the emulator would otherwise really write."""
    if params.get("dryRun"):
        raise StatusError(400, "BadRequest", "dryRun is not emulated (it would really write)")


def check_name(name: Any) -> None:
    """422 unless `name` is a DNS-1123 subdomain, as the API server requires of object names."""
    if not isinstance(name, str) or len(name) > 253 or not _DNS_SUBDOMAIN.match(name):
        raise StatusError(
            422,
            "Invalid",
            f"metadata.name: Invalid value: {name!r}: a lowercase RFC 1123 subdomain must "
            "consist of lower case alphanumeric characters, '-' or '.', and must start and "
            "end with an alphanumeric character",
        )


def _header(headers: Mapping[str, str], name: str) -> str:
    return next((v for k, v in headers.items() if k.lower() == name), "")


def response_format(headers: Mapping[str, str]) -> str:
    """What the client accepts, in its order of preference: "json" or "table"; 406 otherwise.

    kubectl get asks `application/json;as=Table;v=v1;g=meta.k8s.io, (the same for v1beta1),
    application/json`; the first media range the emulator can produce wins. An absent Accept
    means JSON.
    """
    accept = _header(headers, "accept").strip()
    if not accept:
        return "json"
    for media_range in accept.split(","):
        mime, *raw_params = (s.strip() for s in media_range.split(";"))
        params = dict(p.split("=", 1) for p in raw_params if "=" in p)
        if mime.lower() not in ("application/json", "application/*", "*/*"):
            continue
        as_kind = params.get("as")
        if as_kind is None:
            return "json"
        if as_kind == "Table" and params.get("g") == "meta.k8s.io" and params.get("v") in TABLES:
            return "table"
    raise StatusError(
        406,
        "NotAcceptable",
        f"only application/json and meta.k8s.io/v1 Table are served, not {accept!r}",
    )


@attrs.frozen
class DeleteOptions:
    """The parts of a `DeleteOptions` (JSON body or query) that the emulator honours."""

    grace_period_seconds: int | None = None
    propagation_policy: str = "Background"
    preconditions: Mapping[str, str] = attrs.field(factory=dict)


def delete_options(request_body: bytes, params: Mapping[str, str]) -> DeleteOptions:
    """DeleteOptions from a DELETE's body, with query parameters filling what the body lacks."""
    body = json_body(request_body, {})
    if not isinstance(body, Mapping):
        raise StatusError(400, "BadRequest", "the DELETE body must be a DeleteOptions object")
    if body.get("dryRun") or params.get("dryRun"):
        check_not_dry_run({"dryRun": "All"})
    grace = body.get("gracePeriodSeconds", params.get("gracePeriodSeconds"))
    policy = body.get("propagationPolicy") or params.get("propagationPolicy")
    if body.get("orphanDependents", params.get("orphanDependents")) in (True, "true"):
        policy = policy or "Orphan"
    policy = policy or "Background"
    if policy not in PROPAGATION_POLICIES:
        raise StatusError(422, "Invalid", f"propagationPolicy: Unsupported value: {policy!r}")
    try:
        seconds = None if grace is None else int(grace)
    except (TypeError, ValueError) as exc:
        raise StatusError(400, "BadRequest", f"gracePeriodSeconds: {grace!r}") from exc
    return DeleteOptions(seconds, policy, dict(body.get("preconditions") or {}))
