"""OpenAPI v3 documents of custom resources, as kube-apiserver publishes them: `kubectl explain`.

`kubectl explain ie.spec` reads `GET /openapi/v3` (an index: group-version -> document URL
with a content hash) and then `GET /openapi/v3/apis/GROUP/VERSION`, an OpenAPI 3.0 document
whose `components.schemas` hold each kind's schema, tagged `x-kubernetes-group-version-kind`.
For a custom resource the real server builds that schema from the CRD version's
`openAPIV3Schema`; so does this module, for every served resource that has a schema (the
emulator knows no schemas of built-in kinds, so `kubectl explain pods` is not served).

Differences from the real server: `metadata` stays as the CRD wrote it (the real server swaps
in a `$ref` to the full `ObjectMeta` schema), the documents have no `paths` (kubectl explain
reads only the components), and `/openapi/v2` is not served.

`OpenApiScaffold` adds this to `kubeemu_discovery.DiscoveryScaffold`; `kubeemu.KubeEmu` builds on
it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import aiohttp.web
import attrs
import kmock
from kubeemu_discovery import DiscoveryScaffold, ResourceType

PREFIX = "/openapi/v3"


def _doc_path(group_version: str) -> str:
    """The index key of a group-version: "api/v1" or "apis/GROUP/VERSION"."""
    return f"apis/{group_version}" if "/" in group_version else f"api/{group_version}"


def schema_name(group: str, version: str, kind: str) -> str:
    """A component's name as kube-apiserver writes it: the group reversed, e.g.
    `dev.corefleet.v1alpha1.InferenceEngine` for corefleet.dev/v1alpha1 InferenceEngine."""
    return ".".join([*reversed(group.split(".")), version, kind])


def _operation(action: str, gvk: Mapping[str, str], ref: str) -> dict[str, Any]:
    content = {"application/json": {"schema": {"$ref": ref}}}
    return {
        "responses": {"200": {"description": "OK", "content": content}},
        "x-kubernetes-action": action,
        "x-kubernetes-group-version-kind": dict(gvk),
    }


def _paths(path: str, rtype: ResourceType, gvk: Mapping[str, str], item_ref: str) -> dict[str, Any]:
    """The read operations of one resource: kubectl explain finds the kind of a resource here."""
    group_version, plural = path.rsplit("/", 1)
    root = f"/{_doc_path(group_version)}"
    collection = (
        f"{root}/namespaces/{{namespace}}/{plural}" if rtype.namespaced else f"{root}/{plural}"
    )
    list_ref = item_ref + "List"
    return {
        collection: {"get": _operation("list", gvk, list_ref)},
        f"{collection}/{{name}}": {"get": _operation("get", gvk, item_ref)},
    }


def group_version_document(types: Mapping[str, ResourceType], group_version: str) -> dict[str, Any]:
    """The OpenAPI 3.0 document of one group-version: a schema per kind and one per list."""
    group, _, version = group_version.rpartition("/")
    schemas: dict[str, Any] = {}
    paths: dict[str, Any] = {}
    for path, rtype in sorted(types.items()):
        if path.rsplit("/", 1)[0] != group_version or rtype.schema is None:
            continue
        gvk = {"group": group, "version": version, "kind": rtype.kind}
        schemas[schema_name(group, version, rtype.kind)] = {
            **json.loads(json.dumps(rtype.schema)),
            "x-kubernetes-group-version-kind": [gvk],
        }
        item_ref = f"#/components/schemas/{schema_name(group, version, rtype.kind)}"
        schemas[schema_name(group, version, f"{rtype.kind}List")] = {
            "type": "object",
            "description": f"{rtype.kind}List is a list of {rtype.kind}",
            "required": ["items"],
            "properties": {
                "apiVersion": {"type": "string", "description": "The list's API version."},
                "kind": {"type": "string", "description": "The list's kind."},
                "metadata": {"type": "object", "description": "Standard list metadata."},
                "items": {
                    "type": "array",
                    "description": f"List of {rtype.kind.lower()}s.",
                    "items": {"$ref": item_ref},
                },
            },
            "x-kubernetes-group-version-kind": [{**gvk, "kind": f"{rtype.kind}List"}],
        }
        paths.update(_paths(path, rtype, gvk, item_ref))
    return {
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes CRD Swagger", "version": "v0.1.0"},
        "paths": paths,
        "components": {"schemas": schemas},
    }


def _hash(doc: Mapping[str, Any]) -> str:
    return hashlib.sha512(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:128].upper()


def documents(types: Mapping[str, ResourceType]) -> dict[str, dict[str, Any]]:
    """index key ("apis/corefleet.dev/v1alpha1") -> document, for group-versions with schemas."""
    versions = {p.rsplit("/", 1)[0] for p, t in types.items() if t.schema is not None}
    return {_doc_path(gv): group_version_document(types, gv) for gv in sorted(versions)}


def index(docs: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The `/openapi/v3` answer: each document's URL, with its hash as the real server adds."""
    return {
        "paths": {
            key: {"serverRelativeURL": f"{PREFIX}/{key}?hash={_hash(doc)}"}
            for key, doc in docs.items()
        }
    }


def _not_found() -> aiohttp.web.Response:
    body = {
        "apiVersion": "v1",
        "kind": "Status",
        "metadata": {},
        "status": "Failure",
        "message": "the server could not find the requested resource",
        "reason": "NotFound",
        "details": {},
        "code": 404,
    }
    return aiohttp.web.json_response(body, status=404)


@attrs.define(kw_only=True)
class OpenApiScaffold(DiscoveryScaffold):
    """`DiscoveryScaffold` that also answers `GET /openapi/v3[/api[s]/...]`."""

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        path = request.url.path.rstrip("/")
        if request.method.value.upper() != "GET" or not (
            path == PREFIX or path.startswith(PREFIX + "/")
        ):
            return await super()._handle(request)
        docs = documents(self.types)
        if path == PREFIX:
            return aiohttp.web.json_response(index(docs))
        doc = docs.get(path[len(PREFIX) + 1 :])
        return _not_found() if doc is None else aiohttp.web.json_response(doc)
