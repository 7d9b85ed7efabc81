"""A pod's volumes as folders on the node, filled as the kubelet fills them.

- `emptyDir`: a folder of the pod; `hostPath`: the node's folder;
- `secret` / `configMap`: one file per key (`items` picks and renames keys);
- `projected`: the sources' files side by side, which is how every pod's API access arrives
  (the ServiceAccount admission plugin adds `kube-api-access-*`): a `serviceAccountToken` the
  node asks the TokenRequest API for, bound to the pod as a real kubelet binds it, the
  `kube-root-ca.crt` ConfigMap, and the downward API's namespace.
A missing Secret or ConfigMap that is not `optional` fails the container's creation with the
kubelet's reason.
"""

from __future__ import annotations

import base64
import pathlib
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

Pod = Mapping[str, Any]
Fetch = Callable[[str, str, str], Awaitable[dict[str, Any] | None]]  # (plural, ns, name)
# (service account, expiration seconds, audiences) -> a token bound to the pod
TokenFor = Callable[[str, int, Sequence[str]], Awaitable[str]]
DEFAULT_TOKEN_SECONDS = 3607


class VolumeError(RuntimeError):
    """The volume cannot be set up; the container is not created (kubelet reason + message)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _metadata_field(pod: Pod, path: str) -> str:
    meta = pod.get("metadata") or {}
    if path in ("metadata.name", "metadata.namespace", "metadata.uid"):
        return str(meta.get(path.split(".", 1)[1], ""))
    match = re.fullmatch(r"metadata\.(labels|annotations)(?:\['([^']+)'\])?", path)
    if match and match.group(2):
        return str((meta.get(match.group(1)) or {}).get(match.group(2), ""))
    if match:
        pairs = sorted((meta.get(match.group(1)) or {}).items())
        return "\n".join(f'{k}="{v}"' for k, v in pairs)
    raise VolumeError("CreateContainerConfigError", f"unsupported downward API field {path!r}")


async def _keyed_files(
    kind: str, ref: Mapping[str, Any], folder: pathlib.Path, ns: str, fetch: Fetch
) -> None:
    plural = "secrets" if kind == "secret" else "configmaps"
    name = ref.get("secretName") or ref.get("name", "")
    obj = await fetch(plural, ns, name)
    if obj is None:
        if ref.get("optional"):
            return
        raise VolumeError("CreateContainerConfigError", f'{kind.lower()} "{name}" not found')
    data = obj.get("data") or {}
    items = ref.get("items") or [{"key": key, "path": key} for key in data]
    for item in items:
        if item["key"] not in data:
            if ref.get("optional"):
                continue
            raise VolumeError(
                "CreateContainerConfigError",
                f"couldn't find key {item['key']} in {kind} {ns}/{name}",
            )
        value = data[item["key"]]
        raw = base64.b64decode(value) if kind == "secret" else str(value).encode()
        target = folder / item["path"]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(raw)


async def _projected(
    sources: Sequence[Mapping[str, Any]],
    folder: pathlib.Path,
    pod: Pod,
    fetch: Fetch,
    token_for: TokenFor,
) -> None:
    ns = pod["metadata"].get("namespace", "default")
    account = (pod.get("spec") or {}).get("serviceAccountName") or "default"
    for source in sources:
        if "serviceAccountToken" in source:
            token = source["serviceAccountToken"]
            seconds = int(token.get("expirationSeconds", DEFAULT_TOKEN_SECONDS))
            audiences = [token["audience"]] if token.get("audience") else []
            (folder / token["path"]).write_text(await token_for(account, seconds, audiences))
        elif "configMap" in source or "secret" in source:
            kind = "configMap" if "configMap" in source else "secret"
            await _keyed_files(kind, source[kind], folder, ns, fetch)
        elif "downwardAPI" in source:
            for item in source["downwardAPI"].get("items") or ():
                value = _metadata_field(pod, item["fieldRef"]["fieldPath"])
                (folder / item["path"]).write_text(value)
        else:
            raise VolumeError(
                "CreateContainerConfigError", f"unsupported projected source {sorted(source)}"
            )


async def volume_source(
    volume: Mapping[str, Any],
    folder: pathlib.Path,
    pod: Pod,
    fetch: Fetch,
    token_for: TokenFor,
) -> pathlib.Path:
    """The node folder that holds `volume`'s files (made and filled here when it is the pod's)."""
    ns = pod["metadata"].get("namespace", "default")
    if "hostPath" in volume:
        return pathlib.Path(volume["hostPath"]["path"])
    folder.mkdir(parents=True, exist_ok=True)
    if "emptyDir" in volume:
        folder.chmod(0o777)  # as the kubelet makes it: any user of the pod may write there
        return folder
    for kind in ("secret", "configMap"):
        if kind in volume:
            await _keyed_files(kind, volume[kind], folder, ns, fetch)
            return folder
    if "projected" in volume:
        await _projected(volume["projected"].get("sources") or (), folder, pod, fetch, token_for)
        return folder
    raise VolumeError(
        "CreateContainerConfigError",
        f"volume {volume.get('name')!r}: only emptyDir, hostPath, secret, configMap and "
        "projected are supported by the local kubelet",
    )
