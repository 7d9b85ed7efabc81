"""The real API server's audit log: who sent which request, and what the server answered.

The emulator keeps a request log in memory; on a real kube-apiserver the same record is its
audit log. `audit_flags(folder)` writes a policy and returns the flags that turn the log on
(`ControlPlane(extra_apiserver_flags=...)`); `AuditLog(path)` reads it back, incrementally.

The policy records, at the `Metadata` level (verb, user, object reference, response code):
every request of the operator's ServiceAccounts (group `system:serviceaccounts:corefleet-system`),
reads and watches included, and every write of anyone else (the test's admin, the controller
manager). Other reads are not recorded: the test polls the API often and would drown the log.
Only the `ResponseComplete` stage is kept (a watch also logs `ResponseStarted`), so an entry is
one answered request, refused ones included (a create answered 409 is there, with its name:
the server fills `objectRef.name` from the body). The server writes an entry as it answers, so
a write's effect can show through the API a moment before its entry does: a test waits for the
entries it expects (`eventually`) rather than reading them once.
"""

from __future__ import annotations

import collections
import json
import pathlib
import threading
from collections.abc import Callable, Iterable
from typing import Any

import yaml

OPERATOR_GROUP = "system:serviceaccounts:corefleet-system"
WRITES = ["create", "update", "patch", "delete", "deletecollection"]
POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [
        {"level": "Metadata", "userGroups": [OPERATOR_GROUP]},
        {"level": "Metadata", "verbs": WRITES},
        {"level": "None"},
    ],
}
CREDENTIAL = "authentication.kubernetes.io/credential-id"
Entry = dict[str, Any]


def audit_flags(folder: pathlib.Path) -> list[str]:
    """kube-apiserver flags for an audit log at `folder/audit.log` (the policy beside it)."""
    folder.mkdir(parents=True, exist_ok=True)
    policy = folder / "audit-policy.yaml"
    policy.write_text(yaml.safe_dump(POLICY))
    return [
        f"--audit-policy-file={policy}",
        f"--audit-log-path={folder / 'audit.log'}",
        "--audit-log-format=json",
        "--audit-log-mode=blocking",
        "--audit-log-maxbackup=0",
    ]


class AuditLog:
    """The entries of an audit log file, read as it grows (thread-safe)."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        self._entries: list[Entry] = []
        self._offset = 0
        self._partial = b""
        self._lock = threading.Lock()

    def entries(self) -> list[Entry]:
        """Every entry so far, in the order the server wrote them."""
        with self._lock:
            if self.path.exists():
                with self.path.open("rb") as handle:
                    handle.seek(self._offset)
                    data = handle.read()
                self._offset += len(data)
                lines = (self._partial + data).split(b"\n")
                self._partial = lines.pop()
                self._entries += [json.loads(line) for line in lines if line.strip()]
            return list(self._entries)

    def select(
        self,
        verb: str | None = None,
        resource: str | None = None,
        user: Callable[[Entry], bool] | None = None,
        subresource: str | None = "",
    ) -> list[Entry]:
        """Entries by verb ("create", "delete", "list", "watch", ...), resource ("pods"),
        requester (`by_user`, `by_credential`) and subresource ("" none, None any)."""
        return [
            e
            for e in self.entries()
            if (verb is None or e.get("verb") == verb)
            and (resource is None or ref(e).get("resource") == resource)
            and (subresource is None or ref(e).get("subresource", "") == subresource)
            and (user is None or user(e))
        ]

    def names(self, verb: str, resource: str, user: Callable[[Entry], bool] | None = None):
        """How many `verb` requests each object name of `resource` got (subresources aside)."""
        return count_names(self.select(verb, resource, user))


def ref(entry: Entry) -> dict[str, Any]:
    """An entry's object reference ({} when none)."""
    return entry.get("objectRef") or {}


def count_names(entries: Iterable[Entry]) -> collections.Counter[str]:
    """How many entries name each object."""
    return collections.Counter(str(ref(e).get("name", "?")) for e in entries)


def by_user(username: str) -> Callable[[Entry], bool]:
    """Entries sent as this user."""
    return lambda e: (e.get("user") or {}).get("username") == username


def in_group(group: str = OPERATOR_GROUP) -> Callable[[Entry], bool]:
    """Entries sent by a member of this group (default: the operator's ServiceAccounts)."""
    return lambda e: group in ((e.get("user") or {}).get("groups") or [])


def forbidden(entries: Iterable[Entry]) -> list[str]:
    """The refused (403) requests among entries, as `verb URI (user)` lines."""
    return [
        f"{e.get('verb')} {e.get('requestURI')} ({(e.get('user') or {}).get('username')})"
        for e in entries
        if code(e) == 403
    ]


def by_credential(credential: str) -> Callable[[Entry], bool]:
    """Entries sent with this token (`chart_install.credential_id`)."""
    return lambda e: credential in ((e.get("user") or {}).get("extra") or {}).get(CREDENTIAL, [])


def code(entry: Entry) -> int:
    """The HTTP status the server answered."""
    return int((entry.get("responseStatus") or {}).get("code") or 0)
