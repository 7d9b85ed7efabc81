"""Images for the container mode, as the local Docker engine holds them (`make images`).

A kubelet asks its runtime for an image's root filesystem and its configuration; here the
root filesystem is the image's layers in Docker's overlay2 store, stacked read-only under each
container's own writable layer (`runc_runtime`), so a container starts without copying
gigabytes. No registry is reachable: an image the engine does not hold fails as the kubelet
fails a pull (`ErrImagePull`), or, with `imagePullPolicy: Never`, `ErrImageNeverPull`.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
import subprocess

from container_spec import ContainerConfigError

DOCKER = shutil.which("docker") or "/usr/bin/docker"


@dataclasses.dataclass(frozen=True)
class ImageConfig:
    """What a container of the image starts from."""

    reference: str
    image_id: str  # sha256:..., reported as the container's imageID
    layers: tuple[str, ...]  # layer folders, topmost first (overlayfs lowerdir order)
    entrypoint: tuple[str, ...]
    cmd: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    user: str  # "", "uid", "uid:gid" or a name
    workdir: str


def docker_available() -> str | None:
    """None when a Docker engine answers, else why not (for a skip reason)."""
    if not pathlib.Path(DOCKER).exists():
        return "no docker client"
    done = subprocess.run([DOCKER, "info"], capture_output=True, text=True, timeout=60)
    return None if done.returncode == 0 else f"no Docker engine answers: {done.stderr.strip()}"


def inspect_image(reference: str, pull_policy: str = "IfNotPresent") -> ImageConfig:
    """The image as the engine holds it, or the error a failed pull reports."""
    done = subprocess.run(
        [DOCKER, "image", "inspect", reference], capture_output=True, text=True, timeout=60
    )
    if done.returncode != 0:
        if pull_policy == "Never":
            raise ContainerConfigError(
                "ErrImageNeverPull",
                f'Container image "{reference}" is not present with pull policy of Never',
            )
        raise ContainerConfigError(
            "ErrImagePull",
            f'failed to pull image "{reference}": no registry is reachable from this node and '
            "the local Docker engine does not hold it (make images builds ours)",
        )
    (found,) = json.loads(done.stdout)
    driver = found.get("GraphDriver") or {}
    if driver.get("Name") != "overlay2":
        raise ContainerConfigError(
            "CreateContainerError",
            f"image store {driver.get('Name')!r}: only overlay2 is supported",
        )
    data = driver.get("Data") or {}
    layers = [data["UpperDir"], *[d for d in (data.get("LowerDir") or "").split(":") if d]]
    config = found.get("Config") or {}
    pairs = [item.partition("=") for item in config.get("Env") or () if "=" in item]
    env = tuple((name, value) for name, _, value in pairs)
    return ImageConfig(
        reference=reference,
        image_id=found["Id"],
        layers=tuple(layers),
        entrypoint=tuple(config.get("Entrypoint") or ()),
        cmd=tuple(config.get("Cmd") or ()),
        env=env,
        user=config.get("User") or "",
        workdir=config.get("WorkingDir") or "/",
    )
