"""Which coordinators a rank joins: ``--coordinator`` entries resolved to every address.

A rank joins every coordinator of its fleet (several coordinators share the ranks, none owns
them). It finds them by name: ``--coordinator`` lists one or more ``HOST:PORT`` entries
(comma-separated), and each host name is resolved to *all* its addresses. A Kubernetes
headless Service of the coordinator pods resolves to one address per pod, so the rank joins
each pod; a name re-resolved later (``CoordinatorResolver.resolve`` is called periodically)
brings in coordinators that were added or restarted, and drops the ones that went away.

An IP literal, an ``ipc://`` address and a ``tcp://`` address whose host is a literal are
used as given. A name that does not resolve (yet) yields no address; that is logged once per
change, not at every retry.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Callable

from corefleet.engine.transport.sockets import handshake_address

logger = logging.getLogger(__name__)

AddressInfo = list[tuple[object, object, object, str, tuple[object, ...]]]
Lookup = Callable[[str, int], AddressInfo]


def _getaddrinfo(host: str, port: int) -> AddressInfo:
    return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)  # type: ignore[return-value]


def parse_coordinators(spec: str) -> tuple[str, ...]:
    """``--coordinator``'s value as ZMQ addresses, one per entry (names not resolved yet).

    Raises ValueError naming the bad entry (an empty list, a missing port, a bad scheme).
    """
    entries = [entry.strip() for entry in spec.split(",")]
    if not spec.strip() or any(not entry for entry in entries):
        raise ValueError(
            f"--coordinator {spec!r} must be one or more HOST:PORT entries separated by commas"
        )
    return tuple(dict.fromkeys(handshake_address(entry) for entry in entries))


def _split_tcp(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of a ``tcp://`` address, brackets of an IPv6 literal removed."""
    if not address.startswith("tcp://"):
        return None
    host, _, port = address[len("tcp://") :].rpartition(":")
    if not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def _is_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _tcp(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class CoordinatorResolver:
    """Resolves ``--coordinator``'s entries to the coordinators' handshake addresses."""

    def __init__(self, spec: str, lookup: Lookup = _getaddrinfo) -> None:
        self.entries = parse_coordinators(spec)
        self._lookup = lookup
        self._last: dict[str, tuple[str, ...]] = {}  # entry -> what it last resolved to
        self._failure = ""  # why the latest lookup that failed did

    def resolve(self) -> list[str]:
        """Every coordinator address now, in the entries' order, without duplicates."""
        found: dict[str, None] = {}
        for entry in self.entries:
            addresses = self._resolve_entry(entry)
            if self._last.get(entry) != addresses:
                self._log_change(entry, addresses)
                self._last[entry] = addresses
            found.update(dict.fromkeys(addresses))
        return list(found)

    def _resolve_entry(self, entry: str) -> tuple[str, ...]:
        host_port = _split_tcp(entry)
        if host_port is None or _is_literal(host_port[0]):
            return (entry,)
        host, port = host_port
        try:
            infos = self._lookup(host, port)
        except (OSError, UnicodeError) as exc:  # socket.gaierror is an OSError
            self._failure = str(exc)
            return ()
        self._failure = ""
        return tuple(dict.fromkeys(_tcp(str(info[4][0]), port) for info in infos))

    def _log_change(self, entry: str, addresses: tuple[str, ...]) -> None:
        if addresses:
            logger.info("coordinator %s resolves to %s", entry, ", ".join(addresses))
        else:
            logger.warning(
                "coordinator %s does not resolve (%s); retrying",
                entry,
                self._failure or "no address",
            )
