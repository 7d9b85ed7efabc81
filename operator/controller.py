"""Glue between kopf's handlers and the pure parts: observe -> plan -> act -> status.

`main.py`'s handlers (create, update, resume, the timer, pod events) all call
`reconcile_engine` for one InferenceEngine. It reads the children from kopf's in-memory indexes,
asks `reconcile.plan` for actions, executes them with the operator's API client, posts Events,
and writes `.status` through the status subresource when it changed. It lists only before it
creates (`_already_there`: the indexes may lag, e.g. on a standby that just took over) and every
`resync_seconds` (`_find_vanished`).
Calls for the same engine are serialized and coalesced: a burst of pod events causes one
reconcile that sees the latest state, not one per event.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import datetime
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, cast

import aiohttp
import kopf

from corefleet.operator import admin
from corefleet.operator import pods as podlib
from corefleet.operator.curve import generate_keys
from corefleet.operator.events import transition_events
from corefleet.operator.kube import KubeClient, KubeError
from corefleet.operator.naming import (
    COMPONENT_LABEL,
    ENGINE_LABEL,
    Owner,
    coordinator_name,
    curve_secret_name,
)
from corefleet.operator.recent import RecentWrites
from corefleet.operator.reconcile import Action, Observed, Policy, plan
from corefleet.operator.spec import EngineSpec, InvalidSpec, parse_spec
from corefleet.operator.status import Context, compute_status, invalid_spec_status

Key = tuple[str, str]  # (namespace, engine name)
RANK_EVENTS = {"RankCreated", "RankScaledDown", "RankReplaced", "RankFailedReplaced"}
CONFLICT_RETRY = 1.0  # seconds before a reconcile that met a 409 Conflict runs again
INDEX_RETRY = 1.0  # seconds before a reconcile whose indexes lag behind the API runs again
# Seconds before a reconcile that met 429 Too Many Requests (API Priority and Fairness sheds
# load) or a 5xx (an API server restarting, an etcd timeout) runs again.
TRANSIENT_RETRY = 5.0
# The labels kopf's child indexes select on (`main.MANAGED`, `main.RANKS`): a listed object that
# has the created manifest's values for these is one the indexes will show once they catch up.
INDEXED_LABELS = (ENGINE_LABEL, "app.kubernetes.io/managed-by", COMPONENT_LABEL)


def _utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


@dataclasses.dataclass
class Runtime:
    """Operator-wide state shared by all handlers (lives in kopf's memo)."""

    policy: Policy = dataclasses.field(default_factory=Policy)
    request_timeout: float = 10.0
    admin_probe: bool = True
    admin_timeout: float = 1.0
    admin_interval: float = 10.0
    clock: Callable[[], datetime.datetime] = _utcnow
    client: KubeClient | None = None
    locks: dict[Key, asyncio.Lock] = dataclasses.field(default_factory=dict)
    pending: set[Key] = dataclasses.field(default_factory=set)
    last_status: dict[Key, dict[str, Any]] = dataclasses.field(default_factory=dict)
    admin_cache: dict[Key, tuple[float, dict[int, str] | None]] = dataclasses.field(
        default_factory=dict
    )
    recent: dict[Key, RecentWrites] = dataclasses.field(default_factory=dict)
    resync_seconds: float = 60.0  # how often the indexed children are checked against a list
    resynced: dict[Key, float] = dataclasses.field(default_factory=dict)  # monotonic time
    vanished: set[str] = dataclasses.field(default_factory=set)  # uids indexed but gone

    def connect(self, info: kopf.ConnectionInfo) -> None:
        """Use new credentials (kopf's login handler calls this)."""
        self.client = KubeClient(info, timeout=self.request_timeout)

    def forget(self, key: Key) -> None:
        """Drop what is remembered about an engine that is gone."""
        self.locks.pop(key, None)
        self.last_status.pop(key, None)
        self.admin_cache.pop(key, None)
        self.recent.pop(key, None)
        self.resynced.pop(key, None)


@dataclasses.dataclass(frozen=True)
class Indexes:
    """kopf's in-memory indexes of the children, keyed by (namespace, engine)."""

    pods: Mapping[Key, Iterable[Mapping[str, Any]]]
    children: Mapping[Key, Iterable[Mapping[str, Any]]]
    vanished: frozenset[str] = frozenset()  # uids to ignore: see `_find_vanished`

    def live_pods(self, key: Key) -> list[Mapping[str, Any]]:
        """The engine's indexed rank pods, less the vanished ones."""
        pods = self.pods.get(key, ())
        return [p for p in pods if p.get("metadata", {}).get("uid") not in self.vanished]

    def live_children(self, key: Key) -> list[Mapping[str, Any]]:
        """The engine's other indexed children, less the vanished ones."""
        return [c for c in self.children.get(key, ()) if c.get("uid") not in self.vanished]

    def observe(self, key: Key, replacements: Mapping[int, int]) -> Observed:
        """The `Observed` input of the reconcile for one engine."""
        pods = {}
        for pod in self.live_pods(key):
            rank = podlib.rank_of(pod)
            if rank is not None:
                pods[rank] = pod
        children = {(c["kind"], c["name"]): c.get("hash") for c in self.live_children(key)}
        return Observed(pods=pods, children=children, replacements=replacements)

    def coordinator_available(self, key: Key) -> bool:
        """The coordinator Deployment reports an available pod."""
        return any(
            c["kind"] == "Deployment" and c.get("available") for c in self.live_children(key)
        )

    def coordinator_summary(self, key: Key) -> str | None:
        """Ready coordinator pods / the count the Deployment asks for; None without it."""
        for child in self.live_children(key):
            if child["kind"] == "Deployment":
                return f"{int(child.get('ready') or 0)}/{int(child.get('desired') or 0)}"
        return None


def _post(body: Mapping[str, Any], kind: str, reason: str, message: str) -> None:
    # kopf only reads apiVersion, kind and metadata from the body to build the reference.
    kopf.event(cast(kopf.Body, body), type=kind, reason=reason, message=message)


async def _execute(
    runtime: Runtime,
    key: Key,
    actions: Iterable[Action],
    pods: Mapping[int, Mapping[str, Any]],
    body: Mapping[str, Any],
    logger: kopf.Logger,
) -> None:
    client, namespace = runtime.client, key[0]
    assert client is not None
    recent = runtime.recent.setdefault(key, RecentWrites())
    for action in actions:
        if action.verb == "create":
            assert action.body is not None
            created = await client.create(action.body)
            recent.note_created(action.kind, action.name, created or action.body)
            if created is None:
                # 409 AlreadyExists: an object of that name is there (e.g. written between
                # `_already_there`'s list and now). This process created nothing: no Event.
                logger.info("%s %s already exists: not created", action.kind, action.name)
                continue
        elif action.verb == "patch":
            assert action.body is not None
            await client.patch(action.kind, namespace, action.name, action.body)
        else:
            await client.delete(action.kind, namespace, action.name)
            if action.kind == "Pod":
                uids = {p["metadata"]["name"]: p["metadata"].get("uid") for p in pods.values()}
                recent.note_deleted(action.name, str(uids.get(action.name)))
        logger.info("%s %s %s: %s", action.verb, action.kind, action.name, action.message)
        if action.reason in RANK_EVENTS:
            _post(body, "Normal", action.reason, action.message)


async def _find_vanished(runtime: Runtime, key: Key, indexes: Indexes) -> None:
    """Add to `runtime.vanished` the engine's indexed children that the API no longer has.

    kopf drops an object from its indexes only on a DELETED watch event. An object deleted while
    a watch was down, when the watch then resumes past the server's history (410 Gone) and kopf
    lists again, stays indexed for good: a rank pod that does would never be recreated. So every
    `resync_seconds` (counted from the engine's first reconcile) the engine's children are listed
    by label, and the indexed uids missing from the lists are ignored. The same catches entries
    a replica kept while peering paused it (it neither watches nor lists then), up to that delay.
    """
    now = time.monotonic()
    last = runtime.resynced.setdefault(key, now)
    if now - last < runtime.resync_seconds or runtime.client is None:
        return
    runtime.resynced[key] = now
    indexed = {p["metadata"].get("uid"): "Pod" for p in indexes.live_pods(key)}
    indexed.update({c.get("uid"): c["kind"] for c in indexes.live_children(key)})
    present: set[Any] = set()
    for kind in sorted(set(indexed.values())):
        found = await runtime.client.list_labelled(kind, key[0], f"{ENGINE_LABEL}={key[1]}")
        present.update(o["metadata"].get("uid") for o in found)
    runtime.vanished.update(str(uid) for uid in indexed.keys() - present if uid)


async def _already_there(client: KubeClient, key: Key, actions: Iterable[Action]) -> list[str]:
    """The objects `actions` would create that the API already has, as `Kind/name`.

    The reconcile trusts kopf's indexes for what is missing, and they are complete only once each
    watch has listed its resource. kopf holds every handler until the first lists are done, but
    only once per process: a replica paused by peering (a standby) stops its watches, and when it
    resumes (the leader is gone) they list again each on its own, with no such gate. The engine's
    resume handler then runs against child indexes that have not seen the children the leader
    made while this replica was paused, and would create ranks that exist (409) and post false
    RankCreated Events. So a reconcile that is about to create lists those kinds first, by the
    engine's label: a list without a resourceVersion is a consistent read on a real API server
    (it sees every write acknowledged before it), so anything it shows is really there.
    """
    creates = [a for a in actions if a.verb == "create" and a.body is not None]
    found: list[str] = []
    for kind in sorted({a.kind for a in creates}):
        listed = await client.list_labelled(kind, key[0], f"{ENGINE_LABEL}={key[1]}")
        present = {o["metadata"].get("name"): o["metadata"].get("labels") or {} for o in listed}
        for action in (a for a in creates if a.kind == kind and a.name in present):
            assert action.body is not None
            wanted = action.body["metadata"].get("labels") or {}
            # Only objects the indexes select count: one without our labels never shows there
            # (waiting for it would never end); its create gets a 409 and posts no Event.
            if all(present[action.name].get(k) == wanted.get(k) for k in INDEXED_LABELS):
                found.append(f"{kind}/{action.name}")
    return found


async def _joined(
    runtime: Runtime, key: Key, ready: bool, spec: EngineSpec
) -> dict[int, str] | None:
    if not (runtime.admin_probe and ready):
        return None
    now = time.monotonic()
    cached = runtime.admin_cache.get(key)
    if cached is not None and now - cached[0] < runtime.admin_interval:
        return cached[1]
    namespace, name = key
    # Through the coordinator's Service, so on the Service's port (spec.coordinator.service).
    port = spec.coordinator.service_port
    url = f"http://{coordinator_name(name)}.{namespace}.svc:{port}/admin/engines"
    api_key = await _api_key(runtime, namespace, spec)
    joined = await admin.fetch_engines(url, runtime.admin_timeout, api_key)
    runtime.admin_cache[key] = (now, joined)
    return joined


async def _api_key(runtime: Runtime, namespace: str, spec: EngineSpec) -> str | None:
    """The coordinator's API key from the Secret the spec names (None: none, or unreadable)."""
    ref = spec.coordinator.api_key_secret_ref
    if ref is None or runtime.client is None:
        return None
    try:
        secret = await runtime.client.get("Secret", namespace, ref.name)
    except KubeError:  # e.g. no RBAC to read it: the status falls back to the pods
        return None
    value = ((secret or {}).get("data") or {}).get(ref.key)
    if not isinstance(value, str):
        return None
    try:
        return base64.b64decode(value).decode().strip()
    except (ValueError, UnicodeDecodeError):
        return None


async def _volume_missing(
    client: KubeClient, namespace: str, volume: Mapping[str, Any] | None, observed: Observed
) -> bool:
    claim = (volume or {}).get("persistentVolumeClaim") or {}
    if not claim.get("claimName"):
        return False
    if observed.pods and all(podlib.is_ready(p) for p in observed.pods.values()):
        return False  # running ranks prove it exists; skip the read
    return await client.get("PersistentVolumeClaim", namespace, claim["claimName"]) is None


async def _write_status(
    runtime: Runtime,
    key: Key,
    body: Mapping[str, Any],
    previous: Mapping[str, Any],
    status: dict[str, Any],
) -> None:
    assert runtime.client is not None
    if status != previous:
        await runtime.client.patch(
            "InferenceEngine", key[0], key[1], {"status": status}, subresource="status"
        )
    runtime.last_status[key] = status
    for event in transition_events(previous, status):
        _post(body, event.type, event.reason, event.message)


async def reconcile_engine(
    body: Mapping[str, Any], runtime: Runtime, indexes: Indexes, logger: kopf.Logger
) -> str | None:
    """Reconcile one InferenceEngine; returns the InvalidSpec message if its spec is unusable.

    Coalesces: if a reconcile for the same engine is already waiting, this call returns at once
    (the waiting one will see the newer state).
    """
    meta = body["metadata"]
    key: Key = (meta["namespace"], meta["name"])
    if meta.get("deletionTimestamp"):
        runtime.forget(key)
        return None
    if key in runtime.pending:
        return None
    runtime.pending.add(key)
    async with runtime.locks.setdefault(key, asyncio.Lock()):
        runtime.pending.discard(key)
        try:
            return await _reconcile_locked(body, key, runtime, indexes, logger)
        except KubeError as exc:
            # Forget the status this process remembers, so the retry starts from the engine kopf
            # last read (a 5xx write may have landed or not), and retry soon: a plain exception
            # would wait for kopf's default back-off (60 s), also in the timer.
            if exc.status == 409:  # someone else changed the object
                runtime.last_status.pop(key, None)
                raise kopf.TemporaryError(
                    f"conflict, retrying: {exc}", delay=CONFLICT_RETRY
                ) from exc
            if exc.status == 429 or exc.status >= 500:  # the API, not the request, failed
                runtime.last_status.pop(key, None)
                raise kopf.TemporaryError(
                    f"API unavailable, retrying in {TRANSIENT_RETRY:.0f} s: {exc}",
                    delay=TRANSIENT_RETRY,
                ) from exc
            raise
        except (TimeoutError, aiohttp.ClientError) as exc:
            # No answer within the client's timeout, or no connection: the API failed, as with
            # a 5xx (a slow Service create on a loaded API server, seen at 200 engines).
            runtime.last_status.pop(key, None)
            raise kopf.TemporaryError(
                f"API unreachable, retrying in {TRANSIENT_RETRY:.0f} s: {exc!r}",
                delay=TRANSIENT_RETRY,
            ) from exc


async def _reconcile_locked(
    body: Mapping[str, Any], key: Key, runtime: Runtime, indexes: Indexes, logger: kopf.Logger
) -> str | None:
    client = runtime.client
    if client is None:
        raise kopf.TemporaryError("not logged in to the API yet", delay=1)
    meta, now = body["metadata"], runtime.clock()
    generation = int(meta.get("generation") or 1)
    previous = runtime.last_status.get(key) or dict(body.get("status") or {})
    try:
        spec = parse_spec(body.get("spec") or {})
    except InvalidSpec as exc:
        await _write_status(
            runtime, key, body, previous, invalid_spec_status(previous, generation, str(exc), now)
        )
        return str(exc)
    owner = Owner(name=key[1], namespace=key[0], uid=meta["uid"])
    await _find_vanished(runtime, key, indexes)
    indexes = dataclasses.replace(indexes, vanished=frozenset(runtime.vanished))
    replacements = {
        int(r["rank"]): int(r["replacements"])
        for r in previous.get("ranks") or []
        if r.get("replacements")
    }
    observed = indexes.observe(key, replacements)
    observed = runtime.recent.setdefault(key, RecentWrites()).overlay(observed)
    secret_missing = ("Secret", curve_secret_name(owner.name)) not in observed.children
    result = plan(
        owner, spec, observed, now, runtime.policy, generate_keys() if secret_missing else None
    )
    behind = await _already_there(client, key, result.actions)
    if behind:
        # The indexes lag behind the API (see `_already_there`): act on nothing and write no
        # status computed from them; run again once the watches have had a moment to list.
        raise kopf.TemporaryError(
            f"children indexes not filled yet ({', '.join(behind)} exist)", delay=INDEX_RETRY
        )
    await _execute(runtime, key, result.actions, observed.pods, body, logger)
    coordinator_ready = indexes.coordinator_available(key)
    ctx = Context(
        generation=generation,
        coordinator_ready=coordinator_ready,
        coordinators=indexes.coordinator_summary(key),
        volume_missing=await _volume_missing(client, key[0], spec.model.volume, observed),
        joined=await _joined(runtime, key, coordinator_ready, spec),
    )
    status = compute_status(owner, spec, observed, result, ctx, previous, now)
    await _write_status(runtime, key, body, previous, status)
    return None
