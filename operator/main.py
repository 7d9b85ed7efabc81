"""kopf handlers of the corefleet operator: `kopf run -m corefleet.operator.main`.

Handlers only. Each one is a thin trigger for `controller.reconcile_engine`, which is
level-based: create, update and resume reconcile at once; a timer re-checks every engine
periodically; and pod events reconcile the pod's engine, found through an index of engines. The
children are known from kopf indexes (`rank_pods`, `children_*`), kept current by watches; a
reconcile lists only to check them (see `controller`). Handlers return None: nothing of kopf's
lands in `.status`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import kopf

from corefleet.operator import settings
from corefleet.operator.controller import Indexes, Runtime, reconcile_engine
from corefleet.operator.kube import KINDS, login
from corefleet.operator.naming import COMPONENT_LABEL, ENGINE_LABEL
from corefleet.operator.pods import pod_hash
from corefleet.operator.spec import GROUP, PLURAL, VERSION

# kopf needs the interval when the decorator runs; this is the one env read at import.
TIMER_SECONDS = settings.OperatorConfig.from_env().timer_seconds
MANAGED: dict[str, Any] = {
    ENGINE_LABEL: kopf.PRESENT,
    "app.kubernetes.io/managed-by": "corefleet-operator",
}
RANKS: dict[str, Any] = {**MANAGED, COMPONENT_LABEL: "engine"}
CHILD_KINDS = (
    "Service",
    "ConfigMap",
    "Secret",
    "Deployment",
    "PodDisruptionBudget",
    "NetworkPolicy",
    "HorizontalPodAutoscaler",
)

__all__ = ["settings"]  # imported for its @kopf.on.startup hook


def _runtime(memo: kopf.Memo) -> Runtime:
    runtime = memo.get("runtime")
    if not isinstance(runtime, Runtime):
        raise kopf.TemporaryError("the operator is still starting", delay=1)
    return runtime


def _indexes(kwargs: Mapping[str, Any]) -> Indexes:
    children: dict[Any, list[Mapping[str, Any]]] = {}
    for kind in CHILD_KINDS:
        for key, values in kwargs[f"children_{KINDS[kind][1]}"].items():
            children.setdefault(key, []).extend(values)
    return Indexes(pods=kwargs["rank_pods"], children=children)


@kopf.on.login()
def login_handler(memo: kopf.Memo, **kwargs: Any) -> kopf.ConnectionInfo | None:
    """In-cluster service account first, then KUBECONFIG; our API client uses the same."""
    info = login(**kwargs)
    if info is not None and isinstance(memo.get("runtime"), Runtime):
        memo["runtime"].connect(info)
    return info


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    """Close the API client's connections."""
    runtime = memo.get("runtime")
    if isinstance(runtime, Runtime) and runtime.client is not None:
        await runtime.client.close()


@kopf.on.probe(id="engines")
def probe_engines(memo: kopf.Memo, **_: Any) -> int:
    """Liveness detail: how many engines the operator has status for."""
    runtime = memo.get("runtime")
    return len(runtime.last_status) if isinstance(runtime, Runtime) else 0


@kopf.index(GROUP, VERSION, PLURAL)
def engines(namespace: str | None, name: str, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    """(namespace, name) -> the InferenceEngine, for pod events to find their engine."""
    return {(namespace, name): dict(body)}


@kopf.index("v1", "pods", labels=RANKS)
def rank_pods(
    namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any
) -> dict[Any, Any]:
    """(namespace, engine) -> its rank pods (metadata, the container image, status)."""
    pod = {
        "metadata": dict(body.metadata),
        "status": dict(body.status),
        "spec": {
            "containers": [{"image": c.get("image")} for c in body.spec.get("containers", [])]
        },
    }
    return {(namespace, labels[ENGINE_LABEL]): pod}


def _index_child(kind: str) -> None:
    prefix, plural = KINDS[kind]
    group_version = prefix.split("/", 1)[1]

    def index(
        namespace: str | None, name: str, labels: kopf.Labels, body: kopf.Body, **_: Any
    ) -> dict[Any, Any]:
        status = body.get("status") or {}
        available = int(status.get("availableReplicas") or 0) > 0
        return {
            (namespace, labels[ENGINE_LABEL]): {
                "kind": kind,
                "name": name,
                "uid": body.metadata.uid,
                "hash": pod_hash(body),
                "available": available,
                # A Deployment's pods: Ready ones and the count it asks for (the HPA's or spec's).
                "ready": int(status.get("readyReplicas") or 0),
                "desired": int((body.get("spec") or {}).get("replicas") or 0),
            }
        }

    group, _, version = group_version.rpartition("/")
    where = (group, version, plural) if group else (version, plural)
    kopf.index(*where, labels=MANAGED, id=f"children_{plural}")(index)


for _kind in CHILD_KINDS:
    _index_child(_kind)


async def _reconcile(
    body: Mapping[str, Any],
    memo: kopf.Memo,
    logger: kopf.Logger,
    kwargs: Mapping[str, Any],
    permanent: bool,
) -> None:
    message = await reconcile_engine(body, _runtime(memo), _indexes(kwargs), logger)
    if message is not None and permanent:
        raise kopf.PermanentError(f"invalid spec: {message}")


@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
@kopf.on.resume(GROUP, VERSION, PLURAL)
async def engine_changed(
    body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **kwargs: Any
) -> None:
    """Reconcile at once when an engine appears, changes, or the operator restarts."""
    await _reconcile(body, memo, logger, kwargs, permanent=True)


@kopf.timer(GROUP, VERSION, PLURAL, interval=TIMER_SECONDS)
async def engine_timer(
    body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **kwargs: Any
) -> None:
    """Level-based safety net: deadlines, back-offs and anything a missed event hid."""
    await _reconcile(body, memo, logger, kwargs, permanent=False)


@kopf.on.event("v1", "pods", labels=RANKS)
async def rank_pod_event(
    namespace: str | None, labels: kopf.Labels, memo: kopf.Memo, logger: kopf.Logger, **kwargs: Any
) -> None:
    """A rank pod changed: reconcile its engine (readiness, failure, deletion)."""
    for body in kwargs["engines"].get((namespace, labels[ENGINE_LABEL]), ()):
        await _reconcile(body, memo, logger, kwargs, permanent=False)


@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True)
def engine_deleted(namespace: str | None, name: str, memo: kopf.Memo, **_: Any) -> None:
    """Forget the engine; its children go with it through their owner references."""
    # InferenceEngine is namespaced: kopf always passes a namespace here.
    _runtime(memo).forget((namespace or "", name))
