"""What this operator wrote moments ago, laid over kopf's indexes until they catch up.

kopf's indexes follow watch events, which lag behind the operator's own writes by a few
milliseconds. A reconcile that runs in that gap (a pod event right after the previous reconcile)
would otherwise create the same children again or delete the same pod twice, posting duplicate
Events. Each entry lives until the index shows the write or `MEMORY_SECONDS` pass.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any

from corefleet.operator import pods as podlib
from corefleet.operator.reconcile import Observed

MEMORY_SECONDS = 10.0


@dataclasses.dataclass
class RecentWrites:
    """Creations and pod deletions of one engine, by (kind, name)."""

    created: dict[tuple[str, str], tuple[float, Mapping[str, Any]]] = dataclasses.field(
        default_factory=dict
    )
    deleted: dict[str, tuple[float, str]] = dataclasses.field(default_factory=dict)  # pod -> uid

    def note_created(self, kind: str, name: str, body: Mapping[str, Any]) -> None:
        """Remember an object the API accepted (or already had)."""
        self.created[(kind, name)] = (time.monotonic(), body)

    def note_deleted(self, name: str, uid: str) -> None:
        """Remember a pod deletion (by uid: a new pod of the same name is not affected)."""
        self.deleted[name] = (time.monotonic(), uid)

    def overlay(self, observed: Observed) -> Observed:
        """`observed` with the remembered writes applied; forgets what the index now shows."""
        now = time.monotonic()
        pods, children = dict(observed.pods), dict(observed.children)
        for (kind, name), (since, body) in list(self.created.items()):
            rank = podlib.rank_of(body)
            seen = (kind, name) in children or (kind == "Pod" and rank in pods)
            if seen or now - since > MEMORY_SECONDS:
                del self.created[(kind, name)]
            elif kind == "Pod" and rank is not None:
                pods[rank] = body
            else:
                children[(kind, name)] = podlib.pod_hash(body)
        by_name = {p.get("metadata", {}).get("name"): r for r, p in pods.items()}
        for name, (since, uid) in list(self.deleted.items()):
            rank = by_name.get(name)
            pod = pods.get(rank) if rank is not None else None
            if (
                rank is None
                or pod is None
                or pod["metadata"].get("uid") != uid
                or podlib.is_terminating(pod)
            ):
                del self.deleted[name]  # gone, replaced, or the index caught up
            elif now - since > MEMORY_SECONDS:
                del self.deleted[name]
            else:
                meta = {**pod["metadata"], "deletionTimestamp": "pending"}
                pods[rank] = {**pod, "metadata": meta}
        return dataclasses.replace(observed, pods=pods, children=children)
