"""A pod's container as an OCI runtime configuration (runc's config.json), by Kubernetes' rules.

What the kubelet and containerd decide before runc starts a container, for the fields pods use:
- the process: `command` replaces the image's ENTRYPOINT (and drops its CMD), `args` replaces
  CMD; `workingDir` over the image's; the user from `runAsUser`/`runAsGroup` (container over
  pod) or the image's USER, with `runAsNonRoot` refusing root as the kubelet does;
  `allowPrivilegeEscalation: false` → no_new_privs; `capabilities` add/drop on containerd's
  default set;
- the root filesystem, read-only with `readOnlyRootFilesystem`;
- mounts: the kernel filesystems every container gets, the pod's /etc/hosts, resolv.conf and
  hostname, the termination-message file, and each `volumeMount` (an `emptyDir` with
  `medium: Memory` is a tmpfs, as the kubelet mounts it; a mount at /dev/shm replaces the
  default 64 MiB one);
- namespaces: the pod's network namespace by path, the rest new;
- resources: `limits.memory` → the memory cgroup's limit (the kernel OOM-kills above it),
  `limits.cpu` → a CFS quota per 100 ms, `requests.cpu` → cpu shares.
"""

from __future__ import annotations

import math
import pathlib
import resource
from collections.abc import Mapping, Sequence
from typing import Any

from container_spec import ContainerConfigError, expand, parse_quantity
from docker_images import ImageConfig

# containerd's default capabilities (oci.DefaultCapabilities), which a pod adds to and drops from.
DEFAULT_CAPABILITIES = [
    "CHOWN", "DAC_OVERRIDE", "FSETID", "FOWNER", "MKNOD", "NET_RAW", "SETGID", "SETUID",
    "SETFCAP", "SETPCAP", "NET_BIND_SERVICE", "SYS_CHROOT", "KILL", "AUDIT_WRITE",
]  # fmt: skip
CPU_PERIOD_US = 100_000
MASKED_PATHS = [
    "/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
    "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi", "/sys/firmware",
]  # fmt: skip
READONLY_PATHS = ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"]


def argv(container: Mapping[str, Any], image: ImageConfig, env: Mapping[str, str]) -> list[str]:
    """The process's argv, Kubernetes' way of combining command/args with the image's; `$(VAR)`
    expands in the pod's command and args, never in the image's."""
    command = [expand(str(a), env) for a in container.get("command") or ()]
    args = container.get("args")
    args = None if args is None else [expand(str(a), env) for a in args]
    if command:
        out = [*command, *(args or [])]
    else:
        out = [*image.entrypoint, *(args if args is not None else image.cmd)]
    if not out:
        raise ContainerConfigError("CreateContainerError", "no command specified")
    return [str(a) for a in out]


def _context(pod: Mapping[str, Any], container: Mapping[str, Any], key: str) -> Any:
    """A securityContext field: the container's, else the pod's."""
    own = (container.get("securityContext") or {}).get(key)
    return (
        own if own is not None else ((pod.get("spec") or {}).get("securityContext") or {}).get(key)
    )


def _passwd_entry(rootfs: pathlib.Path, name: str) -> tuple[int, int] | None:
    path = rootfs / "etc" / "passwd"
    for line in path.read_text(errors="replace").splitlines() if path.exists() else ():
        fields = line.split(":")
        if len(fields) >= 4 and fields[0] == name:
            return int(fields[2]), int(fields[3])
    return None


def run_as(
    pod: Mapping[str, Any], container: Mapping[str, Any], image: ImageConfig, rootfs: pathlib.Path
) -> dict[str, Any]:
    """The OCI `process.user`; refuses root (or an unverifiable user) under runAsNonRoot."""
    uid, gid = _context(pod, container, "runAsUser"), _context(pod, container, "runAsGroup")
    name, _, group = image.user.partition(":")
    where = f"(pod: {pod['metadata']['name']}, container: {container.get('name')})"
    if uid is None and name and not name.isdigit():
        entry = _passwd_entry(rootfs, name)
        if _context(pod, container, "runAsNonRoot"):
            raise ContainerConfigError(
                "CreateContainerConfigError",
                f"container has runAsNonRoot and image has non-numeric user ({name}), "
                f"cannot verify user is non-root {where}",
            )
        if entry is None:
            raise ContainerConfigError(
                "CreateContainerError", f"unable to find user {name}: no matching entries"
            )
        uid, gid = entry[0], gid if gid is not None else entry[1]
    uid = int(uid if uid is not None else (name or 0))
    if gid is None:
        gid = int(group) if group.isdigit() else 0
    if uid == 0 and _context(pod, container, "runAsNonRoot"):
        raise ContainerConfigError(
            "CreateContainerConfigError",
            f"container has runAsNonRoot and image will run as root {where}",
        )
    security = (pod.get("spec") or {}).get("securityContext") or {}
    extra = [int(g) for g in security.get("supplementalGroups") or ()]
    if security.get("fsGroup") is not None:
        extra.append(int(security["fsGroup"]))
    return {"uid": uid, "gid": int(gid), "additionalGids": sorted(set(extra))}


def capabilities(container: Mapping[str, Any]) -> list[str]:
    """containerd's default set with the container's `add`, less its `drop` (ALL: every one)."""
    wanted = (container.get("securityContext") or {}).get("capabilities") or {}
    drop = {str(c).upper() for c in wanted.get("drop") or ()}
    caps = [] if "ALL" in drop else [c for c in DEFAULT_CAPABILITIES if c not in drop]
    caps += [str(c).upper() for c in wanted.get("add") or () if str(c).upper() not in caps]
    return [f"CAP_{c}" for c in caps]


def resources(container: Mapping[str, Any]) -> dict[str, Any]:
    """The cgroup settings of the container's requests and limits."""
    wanted = container.get("resources") or {}
    limits, requests = wanted.get("limits") or {}, wanted.get("requests") or {}
    out: dict[str, Any] = {"devices": [{"allow": False, "access": "rwm"}]}
    if "memory" in limits:
        out["memory"] = {"limit": int(parse_quantity(limits["memory"]))}
    cpu: dict[str, Any] = {}
    if "cpu" in limits:
        cpu["quota"] = max(1000, math.ceil(parse_quantity(limits["cpu"]) * CPU_PERIOD_US))
        cpu["period"] = CPU_PERIOD_US
    request = requests.get("cpu", limits.get("cpu"))
    if request is not None:
        cpu["shares"] = max(2, math.ceil(parse_quantity(request) * 1024))
    if cpu:
        out["cpu"] = cpu
    return out


def _bind(source: pathlib.Path | str, target: str, read_only: bool = False) -> dict[str, Any]:
    return {
        "destination": target,
        "type": "bind",
        "source": str(source),
        "options": ["rbind", "ro" if read_only else "rw"],
    }


def mounts(
    pod: Mapping[str, Any],
    container: Mapping[str, Any],
    volumes: Mapping[str, pathlib.Path],
    etc: pathlib.Path,
    termination_log: pathlib.Path,
) -> list[dict[str, Any]]:
    """Kernel filesystems, the pod's /etc files, the termination log, then the volumeMounts."""
    by_name = {v["name"]: v for v in (pod.get("spec") or {}).get("volumes") or ()}
    wanted = container.get("volumeMounts") or []
    shm_volume = any(m["mountPath"].rstrip("/") == "/dev/shm" for m in wanted)
    out: list[dict[str, Any]] = [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
        {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
         "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
        {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue",
         "options": ["nosuid", "noexec", "nodev"]},
        {"destination": "/sys", "type": "sysfs", "source": "sysfs",
         "options": ["nosuid", "noexec", "nodev", "ro"]},
        {"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup",
         "options": ["nosuid", "noexec", "nodev", "relatime", "ro"]},
    ]  # fmt: skip
    if not shm_volume:
        out.append(
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
             "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]}
        )  # fmt: skip
    out += [_bind(etc / name, f"/etc/{name}") for name in ("hosts", "resolv.conf", "hostname")]
    path = container.get("terminationMessagePath") or "/dev/termination-log"
    out.append(_bind(termination_log, path))
    for mount in wanted:
        volume = by_name.get(mount["name"]) or {}
        medium = (volume.get("emptyDir") or {}).get("medium")
        if medium == "Memory":
            options = ["nosuid", "nodev", "mode=1777"]
            size = (volume.get("emptyDir") or {}).get("sizeLimit")
            if size:
                options.append(f"size={int(parse_quantity(size))}")
            out.append(
                {"destination": mount["mountPath"], "type": "tmpfs", "source": "tmpfs",
                 "options": options}
            )  # fmt: skip
            continue
        out.append(_bind(volumes[mount["name"]], mount["mountPath"], bool(mount.get("readOnly"))))
    return out


def oci_config(
    pod: Mapping[str, Any],
    container: Mapping[str, Any],
    image: ImageConfig,
    process_argv: Sequence[str],
    env: Mapping[str, str],
    user: Mapping[str, Any],
    rootfs: pathlib.Path,
    mount_list: list[dict[str, Any]],
    netns: str,
    hostname: str,
    cgroup: str,
) -> dict[str, Any]:
    """The whole config.json."""
    security = container.get("securityContext") or {}
    caps = capabilities(container)
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if user["uid"] != 0:
        effective: list[str] = []  # a non-root process keeps its capabilities only as bounds
    else:
        effective = caps
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": dict(user),
            "args": list(process_argv),
            "env": [f"{k}={v}" for k, v in env.items()],
            "cwd": container.get("workingDir") or image.workdir or "/",
            "capabilities": {
                "bounding": caps,
                "effective": effective,
                "permitted": effective,
            },
            # As containerd passes on its own: the node's hard limit (runc may not raise it).
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": nofile, "soft": nofile}],
            "noNewPrivileges": security.get("allowPrivilegeEscalation") is False,
        },
        "root": {"path": str(rootfs), "readonly": bool(security.get("readOnlyRootFilesystem"))},
        "hostname": hostname,
        "mounts": mount_list,
        "linux": {
            "namespaces": [
                {"type": "pid"},
                {"type": "ipc"},
                {"type": "uts"},
                {"type": "mount"},
                {"type": "network", "path": f"/var/run/netns/{netns}"},
            ],
            "cgroupsPath": cgroup,
            "resources": resources(container),
            "maskedPaths": MASKED_PATHS,
            "readonlyPaths": READONLY_PATHS,
        },
    }
