"""From a pod's container spec to what the local kubelet runs: argv, env and mounts.

What a kubelet resolves before it starts a container, following Kubernetes' rules:
- env: literal values, the downward API (`fieldRef`: metadata.name/namespace/uid/labels,
  spec.nodeName, status.podIP/hostIP; `resourceFieldRef`: a container's requests and limits of
  cpu and memory over a divisor, rounded up, as the kubelet writes them), `secretKeyRef` and
  `configMapKeyRef` (missing and not `optional` → the container cannot be created, with the
  real reason);
- `$(VAR)` in env values, command and args expands to an earlier-defined variable, `$$` escapes,
  an unknown name stays as written;
- volumes: folders of the pod (`pod_volumes.py`: emptyDir, secret, configMap, projected with the
  service-account token) or of the node (hostPath); each `volumeMount` is a bind mount, and a
  mount point under /var/run/secrets (where the API token goes) is made on the node if missing;
- the image: a known image is this machine's corefleet installation plus a layer of files at
  the paths the Dockerfile gives them (overlaid on the node's folders); an unknown image fails
  as a pull would.
"""

from __future__ import annotations

import base64
import dataclasses
import fnmatch
import math
import os
import pathlib
import re
from collections.abc import Awaitable, Callable, Mapping
from fractions import Fraction
from typing import Any

from netns import Mount
from pod_volumes import TokenFor, VolumeError, volume_source

Pod = Mapping[str, Any]
Fetch = Callable[[str, str, str], Awaitable[dict[str, Any] | None]]  # (plural, ns, name)
SECRETS_MOUNT_ROOT = "/var/run/secrets/"
_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


class ContainerConfigError(RuntimeError):
    """The container cannot be created as specified (kubelet reason + message)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class Image:
    """What an image means on this node: files (container path → node path) over the host."""

    pattern: str  # fnmatch pattern of image references, e.g. "ghcr.io/corefleet/corefleet:*"
    files: Mapping[str, pathlib.Path]
    path: str  # PATH inside the container


@dataclasses.dataclass(frozen=True)
class ContainerPlan:
    """Everything needed to start one container."""

    argv: list[str]
    env: dict[str, str]
    mounts: list[Mount]
    workdir: str


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: known names replaced, `$$` → `$`, others kept."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env.get(name, match.group(0))

    return _VAR.sub(one, text)


def find_image(reference: str, images: list[Image]) -> Image:
    """The node's image for a reference, or the error a failed pull reports."""
    for image in images:
        if fnmatch.fnmatchcase(reference, image.pattern):
            return image
    known = ", ".join(i.pattern for i in images) or "none"
    raise ContainerConfigError(
        "ErrImagePull", f'image "{reference}" is not available on this node (it has: {known})'
    )


def image_layer(image: Image, root: pathlib.Path) -> list[Mount]:
    """Overlay mounts putting the image's files at their paths (one per top-level folder)."""
    tops: dict[str, pathlib.Path] = {}
    for inside, node_path in image.files.items():
        parts = pathlib.PurePosixPath(inside).parts  # ("/", "opt", "corefleet", ...)
        top = parts[1]
        layer = root / top
        dest = layer.joinpath(*parts[2:])
        dest.parent.mkdir(parents=True, exist_ok=True)
        if not dest.is_symlink():
            dest.symlink_to(node_path)
        if not os.path.isdir(f"/{top}"):
            raise ContainerConfigError(
                "CreateContainerError", f"image folder /{top} has no mount point on this node"
            )
        tops[top] = layer
    return [Mount(source=layer, target=f"/{top}", overlay=True) for top, layer in tops.items()]


def _field(pod: Pod, path: str, pod_ip: str, host_ip: str) -> str:
    meta = pod.get("metadata") or {}
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": (pod.get("spec") or {}).get("nodeName", ""),
        "spec.serviceAccountName": (pod.get("spec") or {}).get("serviceAccountName", "default"),
        "status.podIP": pod_ip,
        "status.hostIP": host_ip,
    }
    if path in simple:
        return str(simple[path])
    match = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if match:
        return str((meta.get(match.group(1)) or {}).get(match.group(2), ""))
    raise ContainerConfigError("CreateContainerConfigError", f"unsupported fieldPath {path!r}")


_QUANTITY = re.compile(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
_SUFFIX = {
    None: Fraction(1),
    "m": Fraction(1, 1000),
    **{s: Fraction(1000**i) for i, s in enumerate(("k", "M", "G", "T", "P", "E"), 1)},
    **{s: Fraction(1024**i) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"), 1)},
}


def parse_quantity(text: str) -> Fraction:
    """A Kubernetes resource quantity (``500m``, ``2``, ``1.5``, ``4Gi``) as an exact number."""
    match = _QUANTITY.match(str(text).strip())
    if match is None:
        raise ValueError(f"quantities must match the regular expression {_QUANTITY.pattern!r}")
    return Fraction(match.group(1)) * _SUFFIX[match.group(2)]


def _resource_field(pod: Pod, container: Mapping[str, Any], ref: Mapping[str, Any]) -> str:
    """The kubelet's value of a ``resourceFieldRef``: the quantity over the divisor, rounded up
    (cpu to millicores first, as ``convertResourceCPUToString`` does). An unset request is 0
    (the API server copies limits into unset requests; done here too); an unset limit is the
    node's allocatable (its cores here; memory is not supported)."""
    name = ref.get("containerName") or container.get("name")
    target = next(
        (c for c in (pod.get("spec") or {}).get("containers", []) if c.get("name") == name), None
    )
    if target is None:
        raise ContainerConfigError("CreateContainerConfigError", f"no container {name!r}")
    resource = str(ref.get("resource", ""))
    kind, _, what = resource.partition(".")
    if kind not in ("requests", "limits") or what not in ("cpu", "memory"):
        raise ContainerConfigError(
            "CreateContainerConfigError", f"unsupported resourceFieldRef {resource!r}"
        )
    resources = target.get("resources") or {}
    raw = (resources.get(kind) or {}).get(what)
    if raw is None and kind == "requests":
        raw = (resources.get("limits") or {}).get(what)
    if raw is None and kind == "limits":
        if what != "cpu":
            raise ContainerConfigError(
                "CreateContainerConfigError", "an unset memory limit is not emulated"
            )
        raw = str(os.cpu_count() or 1)
    quantity = parse_quantity(raw) if raw is not None else Fraction(0)
    divisor = parse_quantity(ref.get("divisor") or "1")
    if what == "cpu":  # millicores, rounded up, then divided and rounded up again
        quantity = Fraction(math.ceil(quantity * 1000), 1000)
    return str(math.ceil(quantity / divisor))


async def _key_ref(ref: Mapping[str, Any], plural: str, ns: str, fetch: Fetch) -> str | None:
    obj = await fetch(plural, ns, ref.get("name", ""))
    kind = "secret" if plural == "secrets" else "configmap"
    if obj is None:
        if ref.get("optional"):
            return None
        raise ContainerConfigError(
            "CreateContainerConfigError", f'{kind} "{ref.get("name")}" not found'
        )
    data = obj.get("data") or {}
    if ref.get("key") not in data:
        if ref.get("optional"):
            return None
        raise ContainerConfigError(
            "CreateContainerConfigError",
            f"couldn't find key {ref.get('key')} in {kind.capitalize()} {ns}/{ref.get('name')}",
        )
    value = data[ref["key"]]
    return base64.b64decode(value).decode() if plural == "secrets" else str(value)


def image_env(image: Image, pod: Pod) -> dict[str, str]:
    """What a process-mode image's environment starts from, as a Debian image's would."""
    return {
        "PATH": image.path,
        "HOME": "/root",
        "HOSTNAME": (pod.get("spec") or {}).get("hostname") or pod["metadata"]["name"],
        "LANG": "C.UTF-8",
    }


async def resolve_env(
    pod: Pod,
    container: Mapping[str, Any],
    base: Mapping[str, str],
    pod_ip: str,
    host_ip: str,
    fetch: Fetch,
) -> dict[str, str]:
    """The container's environment: the image's (`base`), then the container's `env` in order."""
    ns = (pod.get("metadata") or {}).get("namespace", "default")
    env = dict(base)
    for item in container.get("env") or ():
        source = item.get("valueFrom")
        if source is None:
            env[item["name"]] = expand(str(item.get("value", "")), env)
            continue
        value: str | None
        if "fieldRef" in source:
            value = _field(pod, source["fieldRef"]["fieldPath"], pod_ip, host_ip)
        elif "resourceFieldRef" in source:
            value = _resource_field(pod, container, source["resourceFieldRef"])
        elif "secretKeyRef" in source:
            value = await _key_ref(source["secretKeyRef"], "secrets", ns, fetch)
        elif "configMapKeyRef" in source:
            value = await _key_ref(source["configMapKeyRef"], "configmaps", ns, fetch)
        else:
            raise ContainerConfigError(
                "CreateContainerConfigError", f"unsupported valueFrom in env {item['name']}"
            )
        if value is not None:
            env[item["name"]] = value
    return env


async def volume_sources(
    pod: Pod, container: Mapping[str, Any], pod_dir: pathlib.Path, fetch: Fetch, token_for: TokenFor
) -> dict[str, pathlib.Path]:
    """Each of the pod's volumes as a node folder (made and filled where it is the pod's), by
    name; a `volumeMount` without its volume is the error the kubelet reports."""
    try:
        sources = {
            v["name"]: await volume_source(
                v, pod_dir / "volumes" / v["name"], pod, fetch, token_for
            )
            for v in (pod.get("spec") or {}).get("volumes") or ()
        }
    except VolumeError as exc:
        raise ContainerConfigError(exc.reason, str(exc)) from exc
    for mount in container.get("volumeMounts") or ():
        if mount["name"] not in sources:
            raise ContainerConfigError(
                "CreateContainerConfigError", f"volumeMount {mount['name']!r} has no volume"
            )
    return sources


async def plan_container(
    pod: Pod,
    image: Image,
    pod_ip: str,
    host_ip: str,
    pod_dir: pathlib.Path,
    fetch: Fetch,
    token_for: TokenFor,
) -> ContainerPlan:
    """Resolve the pod's first container into a plan (raises ContainerConfigError)."""
    spec = pod.get("spec") or {}
    container = (spec.get("containers") or [{}])[0]
    env = await resolve_env(pod, container, image_env(image, pod), pod_ip, host_ip, fetch)
    argv = [expand(a, env) for a in [*container.get("command", []), *container.get("args", [])]]
    if not argv:
        raise ContainerConfigError("CreateContainerError", "no command: the image has no default")
    mounts = image_layer(image, pod_dir / "image")
    sources = await volume_sources(pod, container, pod_dir, fetch, token_for)
    for mount in container.get("volumeMounts") or ():
        if mount["mountPath"].startswith(SECRETS_MOUNT_ROOT):
            os.makedirs(mount["mountPath"], exist_ok=True)  # an empty folder on the node
        if not os.path.exists(mount["mountPath"]):
            raise ContainerConfigError(
                "CreateContainerError",
                f"mount point {mount['mountPath']} does not exist on this node",
            )
        mounts.append(
            Mount(sources[mount["name"]], mount["mountPath"], read_only=bool(mount.get("readOnly")))
        )
    return ContainerPlan(argv, env, mounts, container.get("workingDir") or "/")
