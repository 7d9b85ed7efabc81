"""ZMQ sockets as every corefleet link makes them: heartbeats, no HWM, optional CURVE.

The side that binds (a client or the coordinator) is the CURVE *server*; ranks only connect and
are CURVE *clients*. A CURVE server alone accepts any client that knows the server's public key
and any key pair of its own, so the binding side also runs a ZAP authenticator that admits
exactly one client public key: a peer without it never gets a message through.
"""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import zmq
import zmq.auth.thread
from zmq.utils import z85

from corefleet.engine import envs

logger = logging.getLogger(__name__)

# ZMQ-level liveness on every connection: a ping every second, a peer silent for 5 s is
# disconnected (and asked to drop us after 6 s of our silence).
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000
HEARTBEAT_TTL_MS = 6000

CurveRole = Literal["server", "client"]


@dataclass(frozen=True)
class CurveKeys:
    """One side's CURVE keys, Z85-encoded (40 bytes each).

    ``peer_key`` is the other side's public key: on a rank (client) the server's key to trust,
    on the binding side (server) the one client key it admits.
    """

    public_key: bytes
    secret_key: bytes
    peer_key: bytes

    def __post_init__(self) -> None:
        for name in ("public_key", "secret_key", "peer_key"):
            value = getattr(self, name)
            try:
                ok = len(value) == 40 and len(z85.decode(value)) == 32
            except (ValueError, KeyError, TypeError, IndexError, struct.error):
                ok = False
            if not ok:
                raise ValueError(f"CURVE {name.replace('_', ' ')} is not a 40-character Z85 key")


# Secret key names (as the operator's `<name>-curve` Secret and its volume mount spell them).
_FILES: dict[CurveRole, tuple[str, str, str]] = {
    "server": ("server-public", "server-secret", "client-public"),
    "client": ("client-public", "client-secret", "server-public"),
}


def load_curve_keys(role: CurveRole, keys_dir: str | None = None) -> CurveKeys | None:
    """CURVE keys from a folder (a mounted Secret) or else the environment; None when unset.

    Environment: a rank reads ``COREFLEET_CURVE_{PUBLIC,SECRET,SERVER}_KEY``, the binding side
    ``COREFLEET_CURVE_{PUBLIC,SECRET,CLIENT}_KEY``. Some but not all set is an error.
    """
    if keys_dir is not None:
        folder = Path(keys_dir)
        names = _FILES[role]
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise ValueError(f"CURVE key folder {keys_dir} lacks {', '.join(missing)}")
        public, secret, peer = (_read_key(folder / n) for n in names)
        return CurveKeys(public, secret, peer)
    if role == "client":
        peer_name, peer_value = "COREFLEET_CURVE_SERVER_KEY", envs.curve_server_key()
    else:
        peer_name, peer_value = "COREFLEET_CURVE_CLIENT_KEY", envs.curve_client_key()
    values = {
        "COREFLEET_CURVE_PUBLIC_KEY": envs.curve_public_key(),
        "COREFLEET_CURVE_SECRET_KEY": envs.curve_secret_key(),
        peer_name: peer_value,
    }
    if not any(values.values()):
        return None
    missing = [name for name, value in values.items() if not value]
    if missing:
        raise ValueError(f"CURVE is half configured: {', '.join(missing)} not set")
    # Stripped like key files: a Secret exposed through the environment may end in a newline.
    public, secret, peer = (str(v).strip().encode() for v in values.values())
    return CurveKeys(public, secret, peer)


def _read_key(path: Path) -> bytes:
    return path.read_bytes().strip()


def make_socket(
    ctx: zmq.Context,
    socket_type: int,
    address: str,
    *,
    bind: bool,
    identity: bytes | None = None,
    curve: CurveKeys | None = None,
    linger_ms: int = 0,
) -> zmq.Socket:
    """A socket bound or connected to ``address`` with corefleet's options.

    The binding side is the CURVE server, the connecting side the CURVE client. Unlimited
    high-water marks: the engine never drops a message, back-pressure is the scheduler's job.
    """
    sock = ctx.socket(socket_type)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, linger_ms)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TTL_MS)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if "[" in address:  # tcp://[::1]:5570
        sock.setsockopt(zmq.IPV6, 1)
    if curve is not None:
        sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.public_key)
        sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret_key)
        if bind:
            sock.setsockopt(zmq.CURVE_SERVER, 1)
        else:
            sock.setsockopt(zmq.CURVE_SERVERKEY, curve.peer_key)
    if bind:
        sock.bind(address)
    else:
        # ZMQ resolves a host name (a Service's, which DNS may not know yet) and reconnects by
        # itself; back off exponentially from 100 ms to 5 s instead of retrying at a fixed rate.
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
        sock.connect(address)
    return sock


def bound_address(sock: zmq.Socket) -> str:
    """The address a socket bound to, with the real port when it asked for port 0."""
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    return endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)


class _OneKeyProvider:
    """ZAP credentials check: exactly one client public key is welcome."""

    def __init__(self, allowed_key: bytes) -> None:
        self.allowed = allowed_key  # pyzmq hands the callback Z85-encoded keys

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key == self.allowed
        if not ok:
            logger.warning("refused a CURVE peer with an unknown public key")
        return ok


def start_authenticator(
    ctx: zmq.Context,
    curve: CurveKeys,
) -> zmq.auth.thread.ThreadAuthenticator:
    """Admit only ``curve.peer_key`` on every CURVE server socket of ``ctx``; stop() it last."""
    auth = zmq.auth.thread.ThreadAuthenticator(ctx, log=logger)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=_OneKeyProvider(curve.peer_key))
    return auth


def handshake_address(coordinator: str) -> str:
    """``HOST:PORT`` (or a full ``tcp://``/``ipc://`` address) as a ZMQ address."""
    if "://" in coordinator:
        return coordinator
    host, sep, port = coordinator.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--coordinator {coordinator!r} must be HOST:PORT or a ZMQ address")
    return f"tcp://{host}:{port}"
