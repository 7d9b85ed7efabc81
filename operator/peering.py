"""The peering pre-flight of `corefleet-operator`: is kopf's peering object there?

kopf 1.45 given `--peering NAME` makes peering mandatory: it pauses every handler until its watch
of the peering resource shows the object NAME, and a missing object shows only as a debug line
(its keep-alive PATCH answered 404). An operator whose peering object nobody created waits
forever without a word. So `corefleet-operator` looks first, with the operator's own credentials
(`kube.login`), and only then starts kopf: with peering when every object it needs exists,
otherwise standalone with a warning, or, under `--require-peering` (several replicas), not at
all: it exits with an error. Each message names the missing object and the command creating it.

Which objects: `--all-namespaces` needs the `ClusterKopfPeering` NAME; each `-n NAMESPACE` the
`KopfPeering` NAME in that namespace (kopf keeps one peering per served namespace and pauses the
whole operator while any of them is missing). A namespace pattern (`team-*`, `!kube-*`, `a,b`)
cannot be checked ahead: a namespace created later that matches it would need its own
`KopfPeering` before kopf sees it, or pause every namespace. Patterns therefore run standalone,
and `--require-peering` refuses them: list the namespaces, or use `--all-namespaces`.

The check reads API discovery (`/apis/kopf.dev/v1`, open to every authenticated user) and GETs
each object, which the chart's Role/ClusterRole grant (`get` on the peering kinds).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence

import aiohttp

from corefleet.operator.kube import KubeClient, KubeError, login

GROUP_VERSION = "kopf.dev/v1"
CRDS_COMMAND = "kubectl apply -f crds/kopf-peering.yaml"  # in a corefleet checkout
PATTERN_CHARS = "!*?,"  # what makes a kopf namespace argument a pattern, as kopf decides it

logger = logging.getLogger("corefleet.operator.peering")


def is_pattern(namespace: str) -> bool:
    """Whether a `--namespace` value is a kopf pattern (glob, negation, list), not one name."""
    return any(char in namespace for char in PATTERN_CHARS)


@dataclasses.dataclass(frozen=True)
class PeeringObject:
    """One kopf peering object: cluster-wide (no namespace) or in one namespace."""

    name: str
    namespace: str | None = None

    @property
    def kind(self) -> str:
        """`ClusterKopfPeering` or `KopfPeering`."""
        return "ClusterKopfPeering" if self.namespace is None else "KopfPeering"

    @property
    def plural(self) -> str:
        """The resource name in API paths and discovery."""
        return f"{self.kind.lower()}s"

    @property
    def path(self) -> str:
        """The object's API path."""
        where = "" if self.namespace is None else f"namespaces/{self.namespace}/"
        return f"apis/{GROUP_VERSION}/{where}{self.plural}/{self.name}"

    @property
    def create_command(self) -> str:
        """A shell command that creates the object (kopf fills its status, the spec is empty)."""
        meta = {"name": self.name}
        if self.namespace is not None:
            meta["namespace"] = self.namespace
        manifest = {"apiVersion": GROUP_VERSION, "kind": self.kind, "metadata": meta}
        return f"echo '{json.dumps(manifest)}' | kubectl apply -f -"

    def __str__(self) -> str:
        where = "" if self.namespace is None else f" in namespace {self.namespace!r}"
        return f"{self.kind} {self.name!r}{where}"


def peering_objects(namespaces: Sequence[str], name: str) -> list[PeeringObject]:
    """The objects kopf's peering needs for a scope (no namespaces: every namespace)."""
    if not namespaces:
        return [PeeringObject(name)]
    return [PeeringObject(name, namespace) for namespace in dict.fromkeys(namespaces)]


async def find_problems(client: KubeClient, objects: Sequence[PeeringObject]) -> list[str]:
    """Why peering cannot work, one sentence per object with the fix; [] when it can."""
    discovery = await client.read(f"apis/{GROUP_VERSION}") or {}
    served = {resource.get("name") for resource in discovery.get("resources", [])}
    problems = []
    for obj in objects:
        if obj.plural not in served:
            problems.append(
                f"{obj} cannot exist: kopf's CRD {obj.plural}.kopf.dev is not served; install"
                f" kopf's peering CRDs with `{CRDS_COMMAND}` (from the corefleet repository),"
                f" then create it with `{obj.create_command}`"
            )
        elif await client.read(obj.path) is None:
            problems.append(f"{obj} does not exist; create it with `{obj.create_command}`")
    return problems


@dataclasses.dataclass(frozen=True)
class Preflight:
    """What to check: the served scope, the peering name, and how long one request may take."""

    namespaces: tuple[str, ...]  # empty: every namespace
    name: str
    timeout: float = 10.0

    async def problems(self) -> list[str]:
        """Everything that stands between the operator and working peering ([] if nothing)."""
        patterns = [namespace for namespace in self.namespaces if is_pattern(namespace)]
        if patterns:
            return [
                f"namespace pattern {pattern!r} cannot be checked for a KopfPeering "
                f"{self.name!r} in each namespace it matches, now or later; list the namespaces"
                " (-n NAMESPACE, once each) or serve --all-namespaces with a ClusterKopfPeering"
                for pattern in patterns
            ]
        objects = peering_objects(self.namespaces, self.name)
        info = login()
        if info is None:
            return [
                f"cannot check {', '.join(map(str, objects))}: no Kubernetes credentials (neither"
                " an in-cluster service account nor KUBECONFIG or ~/.kube/config)"
            ]
        client = KubeClient(info, timeout=self.timeout)
        try:
            return await find_problems(client, objects)
        except (KubeError, aiohttp.ClientError, TimeoutError, ValueError) as exc:
            return [
                f"cannot check {', '.join(map(str, objects))} at {info.server}:"
                f" {type(exc).__name__}: {exc}"
            ]
        finally:
            await client.close()


def decide(problems: Sequence[str], required: bool) -> bool:
    """Log the outcome: True runs with peering; False runs standalone; required exits instead."""
    if not problems:
        logger.info("kopf peering objects found: running with leader election")
        return True
    if required:
        for problem in problems:
            logger.error("leader election is required (--require-peering): %s", problem)
        raise SystemExit("corefleet-operator: peering required but not possible; not starting")
    for problem in problems:
        logger.warning(
            "running standalone, without leader election (run a single replica): %s", problem
        )
    return False
