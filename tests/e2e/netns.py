"""Pod sandboxes for the local kubelet: a network namespace, a veth pair and a private address.

One `PodNetwork` per harness owns a Linux bridge with a /24 (the bridge holds the gateway, .1,
so the node — this machine's root namespace — reaches every pod, as a real node does); each
`Sandbox` is one pod's namespace with `eth0` (one end of a veth pair whose other end sits on the
bridge), `lo`, a default route through the gateway, and the two files `ip netns exec` mounts
over the container's `/etc`: `hosts` (Service DNS, rewritten as pods come and go),
`resolv.conf` (no reachable DNS server, so a name missing from `hosts` fails at once instead of
waiting for a timeout) and `host.conf` with `multi on`: without it glibc answers a name from
`hosts` with its first line only, where cluster DNS answers a headless Service's name with every
pod address (`ip netns exec` binds it only over an /etc/host.conf the node has; Debian's does,
and also says `multi on`).

Containers start as `ip netns exec NS sh -c SCRIPT sh ARGV...`: `ip netns exec` enters the
namespace and a private mount namespace, the script makes the container's mounts there (image
files as an overlay, volumes as bind mounts), then `exec`s the command, so the process the
kubelet holds *is* the container's main process.

Names carry this process's pid in hex (`cf-<pid>-...` namespaces, `cfb<pid>` bridges,
`cfv<pid>-<n>` veths): `PodNetwork` removes what a dead harness left behind before it starts,
and `close()` removes everything it made. Needs root and iproute2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import itertools
import os
import pathlib
import re
import shlex
import shutil
import signal
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from typing import IO

IP = shutil.which("ip") or "/usr/sbin/ip"
IPTABLES = shutil.which("iptables")
UNSHARE = shutil.which("unshare") or "/usr/bin/unshare"
NETNS_ETC = pathlib.Path("/etc/netns")
_OURS = re.compile(r"^cf(?:b|v|-)([0-9a-f]+)")


class SandboxError(RuntimeError):
    """A namespace, link or address could not be set up."""


def _ip(*args: str, check: bool = True) -> str:
    done = subprocess.run([IP, *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise SandboxError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def can_create_namespaces() -> str | None:
    """None when this machine can host pod sandboxes, else why not (for a skip reason)."""
    if os.geteuid() != 0:
        return "the local cluster harness needs root (network namespaces, veth pairs, mounts)"
    if not os.path.exists(IP):
        return "iproute2's `ip` is not installed"
    probe = f"cf-{os.getpid():x}-probe"
    try:
        _ip("netns", "add", probe)
    except SandboxError as exc:
        return f"cannot create network namespaces here: {exc}"
    _ip("netns", "del", probe, check=False)
    return None


def pid_alive(pid: int) -> bool:
    """Whether a process of this pid exists (the harness that left a namespace or state)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_leftovers() -> list[str]:
    """Delete namespaces (killing what still runs in them) and links of harnesses whose process
    is gone, e.g. killed by a CI timeout; returns their names."""
    removed = []
    for name in _ip("netns", "list", check=False).split():
        match = _OURS.match(name)
        if match and not pid_alive(int(match.group(1), 16)):
            for pid in _ip("netns", "pids", name, check=False).split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)  # a dead harness's containers
            _ip("netns", "del", name, check=False)
            shutil.rmtree(NETNS_ETC / name, ignore_errors=True)
            removed.append(name)
    for line in _ip("-o", "link", "show", check=False).splitlines():
        link = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        match = _OURS.match(link)
        if match and not pid_alive(int(match.group(1), 16)):
            _ip("link", "del", link, check=False)
            removed.append(link)
    _remove_dead_forward_rules()
    return removed


def _forward_rules(bridge: str, tag: str) -> list[list[str]]:
    """FORWARD rules that let the bridge's traffic pass. Where dockerd runs, bridged frames go
    through iptables (br_netfilter) and dockerd sets the FORWARD policy to DROP: pod to pod
    would time out. The comment names the harness, for `remove_leftovers`."""
    mark = ["-m", "comment", "--comment", f"cf-{tag}"]
    return [["FORWARD", "-i", bridge, *mark, "-j", "ACCEPT"],
            ["FORWARD", "-o", bridge, *mark, "-j", "ACCEPT"]]  # fmt: skip


def _iptables(*args: str) -> None:
    if IPTABLES is not None:
        subprocess.run([IPTABLES, "-w", "10", *args], capture_output=True, timeout=60)


def _remove_dead_forward_rules() -> None:
    if IPTABLES is None:
        return
    listed = subprocess.run(
        [IPTABLES, "-w", "10", "-S", "FORWARD"], capture_output=True, text=True, timeout=60
    ).stdout
    for line in listed.splitlines():
        match = re.search(r'--comment "?cf-([0-9a-f]+)"?', line)
        if line.startswith("-A ") and match and not pid_alive(int(match.group(1), 16)):
            _iptables("-D", *shlex.split(line)[1:])


def _free_subnet() -> ipaddress.IPv4Network:
    used = [
        ipaddress.ip_network(word, strict=False)
        for word in _ip("-4", "route", "show", check=False).split()
        if re.fullmatch(r"\d+\.\d+\.\d+\.\d+(/\d+)?", word)
    ]
    start = os.getpid() % 4000
    for offset in range(4000):
        n = (start + offset) % 4000
        candidate = ipaddress.ip_network(f"10.{200 + n // 256 % 50}.{n % 256}.0/24")
        if not any(candidate.overlaps(u) for u in used):
            return candidate
    raise SandboxError("no free 10.x.y.0/24 for the pod network")


@dataclasses.dataclass(frozen=True)
class Mount:
    """One mount inside a container: a bind of a node path, or an overlay of an image layer."""

    source: pathlib.Path  # node path (bind) or layer folder (overlay, lower layer over target)
    target: str  # path inside the container; must exist on the node
    overlay: bool = False
    read_only: bool = False

    def commands(self) -> list[str]:
        """Shell commands that make this mount (run inside the private mount namespace)."""
        target, source = shlex.quote(self.target), shlex.quote(str(self.source))
        if self.overlay:
            lower = shlex.quote(f"lowerdir={self.source}:{self.target}")
            return [f"mount -t overlay overlay -o {lower} {target}"]
        cmds = [f"mount --bind {source} {target}"]
        if self.read_only:
            cmds.append(f"mount -o remount,bind,ro {target}")
        return cmds


@dataclasses.dataclass
class Sandbox:
    """One pod's network namespace and address."""

    netns: str
    ip: str
    veth: str
    hostname: str = ""  # the pod's hostname: its containers' own UTS name, as in Kubernetes

    @property
    def etc(self) -> pathlib.Path:
        """The folder whose files `ip netns exec` mounts over the container's /etc."""
        return NETNS_ETC / self.netns

    def write_hosts(self, text: str) -> None:
        """Replace the pod's /etc/hosts content in place.

        In place, not by rename: the container sees the file through a bind mount of this
        inode, made when it started; a renamed-over file would never reach it.
        """
        with open(self.etc / "hosts", "w") as handle:
            handle.write(text)

    def spawn(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        mounts: Iterable[Mount],
        workdir: str,
        log: IO[bytes],
    ) -> subprocess.Popen[bytes]:
        """Start a container's main process in this namespace (its own session and group).

        It also gets a UTS namespace of its own named after the pod, as a pod's containers do:
        `gethostname()` is then the name the pod's /etc/hosts maps to its address (gloo, say,
        finds the address to listen on that way), not the node's, which no pod resolves.
        """
        script = ["set -e"]
        if self.hostname:
            script.append(f"printf %s {shlex.quote(self.hostname)} > /proc/sys/kernel/hostname")
        script += [*(c for m in mounts for c in m.commands())]
        script += [f"cd {shlex.quote(workdir)}", 'exec "$@"']
        # unshare execs the shell, which execs the command: the kubelet's process is still the
        # container's main process.
        unshare = [UNSHARE, "--uts", "/bin/sh", "-c", "\n".join(script), "sh"]
        return subprocess.Popen(
            [IP, "netns", "exec", self.netns, *unshare, *argv],
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd="/",
        )


class PodNetwork:
    """The node's pod network: a bridge, a /24, and the sandboxes on it."""

    def __init__(self) -> None:
        remove_leftovers()
        tag = f"{os.getpid():x}"
        self.prefix = f"cf-{tag}"
        self.bridge = f"cfb{tag}"
        self.subnet = _free_subnet()
        hosts = list(self.subnet.hosts())
        self.gateway = str(hosts[0])
        self._free = [str(h) for h in hosts[1:]]
        self._counter = itertools.count(1)
        self._veth_tag = tag
        self.sandboxes: dict[str, Sandbox] = {}
        _ip("link", "add", self.bridge, "type", "bridge")
        try:
            _ip("addr", "add", f"{self.gateway}/{self.subnet.prefixlen}", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for rule in _forward_rules(self.bridge, tag):
                _iptables("-I", *rule)
        except SandboxError:
            _ip("link", "del", self.bridge, check=False)
            raise

    def create(self, pod_name: str, hostname: str, search: Sequence[str]) -> Sandbox:
        """A new namespace wired to the bridge, with its own address and /etc files."""
        if not self._free:
            raise SandboxError(f"the pod network {self.subnet} has no free address")
        n = next(self._counter)
        sandbox = Sandbox(
            netns=f"{self.prefix}-{n}-{pod_name}"[:200],
            ip=self._free.pop(0),  # oldest freed first: an address is not reused at once
            veth=f"cfv{self._veth_tag}-{n:x}",
            hostname=hostname,
        )
        try:
            self._wire(sandbox, hostname, search)
        except SandboxError:
            self.destroy(sandbox)
            raise
        self.sandboxes[sandbox.netns] = sandbox
        return sandbox

    def _wire(self, box: Sandbox, hostname: str, search: Sequence[str]) -> None:
        box.etc.mkdir(parents=True, exist_ok=True)
        box.write_hosts(f"127.0.0.1 localhost\n{box.ip} {hostname}\n")
        (box.etc / "resolv.conf").write_text(
            f"nameserver 127.0.0.1\nsearch {' '.join(search)}\noptions timeout:1 attempts:1\n"
        )
        (box.etc / "hostname").write_text(hostname + "\n")
        if pathlib.Path("/etc/host.conf").exists():
            (box.etc / "host.conf").write_text("multi on\n")
        _ip("netns", "add", box.netns)
        _ip("link", "add", box.veth, "type", "veth", "peer", "name", "eth0", "netns", box.netns)
        _ip("link", "set", box.veth, "master", self.bridge, "up")
        _ip("-n", box.netns, "addr", "add", f"{box.ip}/{self.subnet.prefixlen}", "dev", "eth0")
        _ip("-n", box.netns, "link", "set", "eth0", "up")
        _ip("-n", box.netns, "link", "set", "lo", "up")
        _ip("-n", box.netns, "route", "add", "default", "via", self.gateway)

    def destroy(self, box: Sandbox) -> None:
        """Remove a sandbox (its processes must be gone); the address returns to the pool."""
        _ip("netns", "del", box.netns, check=False)  # takes the veth pair with it
        _ip("link", "del", box.veth, check=False)
        shutil.rmtree(box.etc, ignore_errors=True)
        if self.sandboxes.pop(box.netns, None) is not None:
            self._free.append(box.ip)

    def close(self) -> None:
        """Remove every sandbox and the bridge."""
        for box in list(self.sandboxes.values()):
            self.destroy(box)
        _ip("link", "del", self.bridge, check=False)
        for rule in _forward_rules(self.bridge, self._veth_tag):
            _iptables("-D", *rule)
