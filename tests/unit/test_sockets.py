"""corefleet's ZMQ links: coordinator addresses, socket options, and the authenticator that
admits exactly one client key (over real ZMQ)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import zmq
import zmq.auth.thread
from zmq.utils.monitor import recv_monitor_message

from corefleet.engine.transport import sockets
from corefleet.engine.transport.sockets import (
    CurveKeys,
    bound_address,
    handshake_address,
    make_socket,
    start_authenticator,
)

REFUSAL_WAIT_MS = 1000
DELIVERY_WAIT_MS = 3000


@pytest.fixture
def pairs() -> dict[str, tuple[bytes, bytes]]:
    """Real CURVE key pairs: (public, secret) for the server side and for the client side."""
    return {"server": zmq.curve_keypair(), "client": zmq.curve_keypair()}


# --- handshake_address -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "given,expected",
    [
        ("host:5570", "tcp://host:5570"),
        ("10.0.0.7:1", "tcp://10.0.0.7:1"),
        ("coordinator.ns.svc.cluster.local:5570", "tcp://coordinator.ns.svc.cluster.local:5570"),
        ("[::1]:5570", "tcp://[::1]:5570"),
        ("tcp://1.2.3.4:9", "tcp://1.2.3.4:9"),
        ("ipc:///tmp/x", "ipc:///tmp/x"),
    ],
)
def test_handshake_address(given: str, expected: str) -> None:
    assert handshake_address(given) == expected


@pytest.mark.parametrize("given", ["nohost", "host:", ":5570", "host:abc", "", "host:55 70"])
def test_handshake_address_refuses(given: str) -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        handshake_address(given)


# --- sockets over real ZMQ -------------------------------------------------------------------


class _Net:
    """One context; every socket and authenticator made through it is torn down at the end."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sockets: list[zmq.Socket] = []
        self.auths: list[zmq.auth.thread.ThreadAuthenticator] = []

    def socket(self, socket_type: int, address: str, **kwargs: object) -> zmq.Socket:
        sock = make_socket(self.ctx, socket_type, address, **kwargs)
        self.sockets.append(sock)
        return sock

    def authenticator(self, curve: CurveKeys) -> None:
        self.auths.append(start_authenticator(self.ctx, curve))

    def monitor(self, sock: zmq.Socket) -> zmq.Socket:
        mon = sock.get_monitor_socket()
        self.sockets.insert(0, mon)
        return mon

    def close(self) -> None:
        try:
            for sock in self.sockets:
                sock.close(linger=0)
        finally:
            try:
                for auth in self.auths:
                    auth.stop()
            finally:
                self.ctx.destroy(linger=0)  # closes anything left, then terms


@pytest.fixture
def znet() -> Iterator[_Net]:
    n = _Net()
    try:
        yield n
    finally:
        n.close()


_HANDSHAKE_OUTCOMES = {
    zmq.EVENT_HANDSHAKE_SUCCEEDED,
    zmq.EVENT_HANDSHAKE_FAILED_AUTH,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
}


def _handshake_outcome(monitor: zmq.Socket, timeout_ms: int) -> int | None:
    """The first handshake success/failure event on a server's monitor, or None."""
    deadline = time.monotonic() + timeout_ms / 1000
    while (left_ms := int((deadline - time.monotonic()) * 1000)) > 0:
        if not monitor.poll(left_ms):
            return None
        event = recv_monitor_message(monitor)["event"]
        if event in _HANDSHAKE_OUTCOMES:
            return event
    return None


def _curve_server(
    znet: _Net, pairs: dict[str, tuple[bytes, bytes]]
) -> tuple[zmq.Socket, str, zmq.Socket]:
    """A CURVE PULL server on 127.0.0.1 behind the one-key authenticator, with a monitor
    attached before any client exists (so no handshake event can be missed)."""
    server_public, server_secret = pairs["server"]
    keys = CurveKeys(server_public, server_secret, pairs["client"][0])
    znet.authenticator(keys)
    server = znet.socket(zmq.PULL, "tcp://127.0.0.1:0", bind=True, curve=keys)
    return server, bound_address(server), znet.monitor(server)


def test_bound_address_has_the_real_port(znet: _Net) -> None:
    sock = znet.socket(zmq.PULL, "tcp://127.0.0.1:0", bind=True)
    address = bound_address(sock)
    host_port = address.removeprefix("tcp://")
    assert address.startswith("tcp://127.0.0.1:")
    assert int(host_port.rsplit(":", 1)[1]) > 0


def test_plain_sockets_deliver(znet: _Net) -> None:
    """Control for the refusal tests: without CURVE the harness does deliver."""
    server = znet.socket(zmq.PULL, "tcp://127.0.0.1:0", bind=True)
    client = znet.socket(zmq.PUSH, bound_address(server), bind=False)
    client.send(b"plain")
    assert server.poll(DELIVERY_WAIT_MS)
    assert server.recv() == b"plain"


def test_curve_without_authenticator_delivers(
    znet: _Net, pairs: dict[str, tuple[bytes, bytes]]
) -> None:
    """make_socket's CURVE wiring: bind side is the server, connect side trusts its key."""
    server_public, server_secret = pairs["server"]
    client_public, client_secret = pairs["client"]
    server = znet.socket(
        zmq.PULL,
        "tcp://127.0.0.1:0",
        bind=True,
        curve=CurveKeys(server_public, server_secret, client_public),
    )
    assert server.getsockopt(zmq.CURVE_SERVER) == 1
    client = znet.socket(
        zmq.PUSH,
        bound_address(server),
        bind=False,
        curve=CurveKeys(client_public, client_secret, server_public),
    )
    assert client.getsockopt(zmq.CURVE_SERVER) == 0
    client.send(b"sealed")
    assert server.poll(DELIVERY_WAIT_MS)
    assert server.recv() == b"sealed"


def test_authenticator_admits_the_right_client(
    znet: _Net, pairs: dict[str, tuple[bytes, bytes]]
) -> None:
    server, address, monitor = _curve_server(znet, pairs)
    client_public, client_secret = pairs["client"]
    curve = CurveKeys(client_public, client_secret, pairs["server"][0])
    client = znet.socket(zmq.PUSH, address, bind=False, curve=curve)
    client.send(b"hello rank")
    # Fails fast (not after the full wait) when the handshake is refused.
    assert _handshake_outcome(monitor, DELIVERY_WAIT_MS) == zmq.EVENT_HANDSHAKE_SUCCEEDED
    assert server.poll(DELIVERY_WAIT_MS)
    assert server.recv() == b"hello rank"


def test_authenticator_refuses_an_unknown_client_key(
    znet: _Net, pairs: dict[str, tuple[bytes, bytes]]
) -> None:
    server, address, monitor = _curve_server(znet, pairs)
    stranger_public, stranger_secret = zmq.curve_keypair()
    curve = CurveKeys(stranger_public, stranger_secret, pairs["server"][0])
    client = znet.socket(zmq.PUSH, address, bind=False, curve=curve)
    client.send(b"let me in")
    # Refused by the authenticator (ZAP), not by a broken connection...
    assert _handshake_outcome(monitor, DELIVERY_WAIT_MS) == zmq.EVENT_HANDSHAKE_FAILED_AUTH
    # ...and nothing gets through.
    assert server.poll(REFUSAL_WAIT_MS) == 0


def test_curve_server_refuses_a_plain_client(
    znet: _Net, pairs: dict[str, tuple[bytes, bytes]]
) -> None:
    server, address, monitor = _curve_server(znet, pairs)
    client = znet.socket(zmq.PUSH, address, bind=False)
    client.send(b"no keys at all")
    assert _handshake_outcome(monitor, DELIVERY_WAIT_MS) == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    assert server.poll(REFUSAL_WAIT_MS) == 0


@pytest.mark.parametrize("bind", [True, False], ids=["bind", "connect"])
def test_socket_options(znet: _Net, bind: bool) -> None:
    if bind:
        sock = znet.socket(zmq.ROUTER, "tcp://127.0.0.1:0", bind=True, identity=b"rank-3")
    else:
        sock = znet.socket(zmq.DEALER, "tcp://127.0.0.1:1", bind=False, identity=b"rank-3")
    assert sock.getsockopt(zmq.SNDHWM) == 0
    assert sock.getsockopt(zmq.RCVHWM) == 0
    assert sock.getsockopt(zmq.LINGER) == 0
    assert sock.getsockopt(zmq.HEARTBEAT_IVL) == sockets.HEARTBEAT_IVL_MS
    assert sock.getsockopt(zmq.HEARTBEAT_TIMEOUT) == sockets.HEARTBEAT_TIMEOUT_MS
    assert sock.getsockopt(zmq.HEARTBEAT_TTL) == sockets.HEARTBEAT_TTL_MS
    assert sock.getsockopt(zmq.IDENTITY) == b"rank-3"
    assert sock.getsockopt(zmq.CURVE_SERVER) == 0  # no CURVE unless asked


def test_heartbeats_are_enabled_and_consistent() -> None:
    """A peer must be given longer than one ping interval before it is declared gone."""
    assert 0 < sockets.HEARTBEAT_IVL_MS < sockets.HEARTBEAT_TIMEOUT_MS
    assert sockets.HEARTBEAT_TTL_MS >= sockets.HEARTBEAT_TIMEOUT_MS


def test_linger_is_configurable(znet: _Net) -> None:
    sock = znet.socket(zmq.PUSH, "tcp://127.0.0.1:1", bind=False, linger_ms=250)
    assert sock.getsockopt(zmq.LINGER) == 250
