"""What the Kubernetes emulator serves: resource types, CRD registration and API discovery.

`DiscoveryScaffold` is kmock's `KubernetesScaffold` (HTTP server, `/api`, `/apis`, request log,
reaction DSL) with the built-in resources the operator and the e2e harness use declared (with
their short names and the `all` category), CRDs turned into served resources (kind, scope, short
names, categories, subresources, schema for defaulting, the scale subresource's
`specReplicasPath`, the printer columns), and the discovery answers fixed where kmock 0.8
confuses clients: the core group's `groupVersion` is `v1`, subresources carry their own kind and
verbs (`scale` is an `autoscaling/v1 Scale`, `pods/binding` is create only, `pods/log` get only)
and no short names, and `/version` reports the kubectl generation in use (v1.32). As on the real
server, a request under `/apis/GROUP` for a group nothing serves gets `404 page not found` as
plain text, and one for an unserved resource of a served group a `Status` (`UNKNOWN_RESOURCE`).
`kubeemu.KubeEmu` adds the object store on top.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp.web
import attrs
import kmock
from kmock._internal import parsing

VERBS = {"create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"}
BUILTINS = [  # (group/version, plural, kind, namespaced, subresources)
    ("v1", "namespaces", "Namespace", False, {"status"}),
    ("v1", "nodes", "Node", False, {"status"}),
    ("v1", "pods", "Pod", True, {"status", "binding", "log"}),
    ("v1", "services", "Service", True, {"status"}),
    ("v1", "configmaps", "ConfigMap", True, set()),
    ("v1", "secrets", "Secret", True, set()),
    ("v1", "events", "Event", True, set()),
    ("v1", "persistentvolumeclaims", "PersistentVolumeClaim", True, {"status"}),
    ("apps/v1", "deployments", "Deployment", True, {"status", "scale"}),
    ("policy/v1", "poddisruptionbudgets", "PodDisruptionBudget", True, {"status"}),
    ("networking.k8s.io/v1", "networkpolicies", "NetworkPolicy", True, set()),
    ("autoscaling/v2", "horizontalpodautoscalers", "HorizontalPodAutoscaler", True, {"status"}),
    (
        "apiextensions.k8s.io/v1",
        "customresourcedefinitions",
        "CustomResourceDefinition",
        False,
        {"status"},
    ),
]
SHORT_NAMES = {
    "namespaces": ["ns"],
    "nodes": ["no"],
    "pods": ["po"],
    "services": ["svc"],
    "configmaps": ["cm"],
    "secrets": [],
    "events": ["ev"],
    "persistentvolumeclaims": ["pvc"],
    "deployments": ["deploy"],
    "poddisruptionbudgets": ["pdb"],
    "networkpolicies": ["netpol"],
    "horizontalpodautoscalers": ["hpa"],
    "customresourcedefinitions": ["crd", "crds"],
}
IN_ALL = {"pods", "services", "deployments", "horizontalpodautoscalers"}  # `kubectl get all`
# What the real server's defaulting gives a built-in kind on every write (a path -> value where
# the field is absent), for the fields something here reads: a Deployment without replicas (one
# an HPA owns) has 1 (SetDefaults_Deployment).
BUILTIN_DEFAULTS: dict[str, dict[str, Any]] = {
    "apps/v1/deployments": {
        ".spec.replicas": 1,
        ".spec.strategy.type": "RollingUpdate",
        ".spec.revisionHistoryLimit": 10,
        ".spec.progressDeadlineSeconds": 600,
    }
}
UNKNOWN_RESOURCE = {  # what the real server answers for a resource it does not serve
    "apiVersion": "v1",
    "kind": "Status",
    "metadata": {},
    "status": "Failure",
    "message": "the server could not find the requested resource",
    "reason": "NotFound",
    "details": {},
    "code": 404,
}
SUBRESOURCE_DISCOVERY: dict[str, dict[str, Any]] = {
    "scale": {"kind": "Scale", "group": "autoscaling", "version": "v1"},
    "binding": {"kind": "Binding", "verbs": ["create"]},
    "log": {"verbs": ["get"]},
}


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


@attrs.define(kw_only=True)
class ResourceType:
    """What the emulator knows about one resource beyond discovery."""

    kind: str
    namespaced: bool
    subresources: set[str]
    schema: Mapping[str, Any] | None = None
    replicas_path: str = ".spec.replicas"
    printer_columns: Sequence[Mapping[str, Any]] | None = None  # set (maybe empty) for CRDs
    defaults: Mapping[str, Any] = attrs.field(factory=dict)  # BUILTIN_DEFAULTS of the kind
    crd: str | None = None  # the defining CustomResourceDefinition's name; None: built in


@attrs.define(kw_only=True)
class DiscoveryScaffold(kmock.KubernetesScaffold):
    """kmock's scaffold with declared resource types and discovery clients accept."""

    types: dict[str, ResourceType] = attrs.field(factory=dict, init=False)
    _builtin_payloads: int = attrs.field(default=0, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for gv, plural, kind, namespaced, subs in BUILTINS:
            extra = {"categories": ["all"] if plural in IN_ALL else []}
            extra["defaults"] = BUILTIN_DEFAULTS.get(f"{gv}/{plural}", {})
            self.declare(
                gv, plural, kind, namespaced, subs, shortnames=SHORT_NAMES[plural], **extra
            )
        self._builtin_payloads = len(self._payloads)

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
            categories=set(extra.pop("categories", ())),
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
                categories=names.get("categories", ()),
                schema=(version.get("schema") or {}).get("openAPIV3Schema"),
                replicas_path=(subs.get("scale") or {}).get("specReplicasPath", ".spec.replicas"),
                printer_columns=list(version.get("additionalPrinterColumns") or []),
                crd=(crd.get("metadata") or {}).get("name") or f"{names['plural']}.{spec['group']}",
            )

    def unregister_crd(self, name: str) -> list[str]:
        """Stop serving the resources a CustomResourceDefinition defined; their paths."""
        paths = [path for path, rtype in self.types.items() if rtype.crd == name]
        for path in paths:
            del self.types[path]
            del self.resources[path]
        return paths

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        parts = request.url.path.strip("/").split("/")
        groups = {key.group for key in self.resources if key.group}
        if len(parts) >= 2 and parts[0] == "apis" and parts[1] not in groups:
            # The real server's answer for a group nothing serves: not a Status, plain text.
            return aiohttp.web.Response(status=404, text="404 page not found\n")
        return await super()._handle(request)

    async def _render_error(self, exc: Exception) -> aiohttp.web.StreamResponse:
        if isinstance(exc, kmock.KubernetesNotFoundError):  # a path no served resource matches
            return aiohttp.web.json_response(UNKNOWN_RESOURCE, status=404)
        return await super()._render_error(exc)

    async def _serve_version(self, request: kmock.Request) -> Any:
        doc = await super()._serve_version(request)
        if request.resource is not None and request.resource.group == "":
            doc["groupVersion"] = "v1"  # kmock writes "/v1", which clients reject
        for entry in doc.get("resources", []):
            if "/" in entry["name"]:
                entry.update(shortNames=[], categories=[], verbs=["get", "patch", "update"])
                entry.update(SUBRESOURCE_DISCOVERY.get(entry["name"].split("/", 1)[1], {}))
        return doc

    async def _serve_server_version(self, request: kmock.Request) -> Any:
        doc = await super()._serve_server_version(request)
        doc.update(minor="32", gitVersion="v1.32.0-kubeemu", goVersion="go1.23.0")
        return doc
