"""corefleet's ZMQ links: CURVE keys from a folder or the environment, coordinator addresses,
socket options, and the authenticator that admits exactly one client key (over real ZMQ)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
import zmq.auth.thread
from zmq.utils.monitor import recv_monitor_message

from corefleet.engine.transport import sockets
from corefleet.engine.transport.sockets import (
    CurveKeys,
    bound_address,
    handshake_address,
    load_curve_keys,
    make_socket,
    start_authenticator,
)

ENV_VARS = (
    "COREFLEET_CURVE_PUBLIC_KEY",
    "COREFLEET_CURVE_SECRET_KEY",
    "COREFLEET_CURVE_SERVER_KEY",
    "COREFLEET_CURVE_CLIENT_KEY",
)

REFUSAL_WAIT_MS = 1000
DELIVERY_WAIT_MS = 3000


@pytest.fixture(autouse=True)
def _no_curve_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The machine's own CURVE variables must not leak into any test."""
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def pairs() -> dict[str, tuple[bytes, bytes]]:
    """Real CURVE key pairs: (public, secret) for the server side and for the client side."""
    return {"server": zmq.curve_keypair(), "client": zmq.curve_keypair()}


def _write_keys(folder: Path, pairs: dict[str, tuple[bytes, bytes]], suffix: bytes = b"") -> None:
    for side, (public, secret) in pairs.items():
        (folder / f"{side}-public").write_bytes(public + suffix)
        (folder / f"{side}-secret").write_bytes(secret + suffix)


# --- load_curve_keys from a folder -----------------------------------------------------------


@pytest.mark.parametrize("suffix", [b"", b"\n"], ids=["exact", "trailing-newline"])
def test_folder_keys_per_role(
    tmp_path: Path, pairs: dict[str, tuple[bytes, bytes]], suffix: bytes
) -> None:
    _write_keys(tmp_path, pairs, suffix)
    server_public, server_secret = pairs["server"]
    client_public, client_secret = pairs["client"]

    server = load_curve_keys("server", str(tmp_path))
    assert server == CurveKeys(server_public, server_secret, client_public)

    client = load_curve_keys("client", str(tmp_path))
    assert client == CurveKeys(client_public, client_secret, server_public)


def test_folder_needs_only_the_roles_own_files(
    tmp_path: Path, pairs: dict[str, tuple[bytes, bytes]]
) -> None:
    """A rank's mounted Secret holds no server secret, the coordinator's no client secret."""
    _write_keys(tmp_path, pairs)
    (tmp_path / "server-secret").unlink()
    assert load_curve_keys("client", str(tmp_path)) is not None
    _write_keys(tmp_path, pairs)
    (tmp_path / "client-secret").unlink()
    assert load_curve_keys("server", str(tmp_path)) is not None


@pytest.mark.parametrize(
    "role,missing",
    [
        ("server", "server-public"),
        ("server", "server-secret"),
        ("server", "client-public"),
        ("client", "client-public"),
        ("client", "client-secret"),
        ("client", "server-public"),
    ],
)
def test_folder_missing_file_is_named(
    tmp_path: Path, pairs: dict[str, tuple[bytes, bytes]], role: str, missing: str
) -> None:
    _write_keys(tmp_path, pairs)
    (tmp_path / missing).unlink()
    with pytest.raises(ValueError, match=missing):
        load_curve_keys(role, str(tmp_path))


def test_folder_that_does_not_exist_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="client-secret"):
        load_curve_keys("client", str(tmp_path / "nowhere"))


def _malformed(pairs: dict[str, tuple[bytes, bytes]]) -> dict[str, bytes]:
    good = pairs["server"][0]
    return {
        "too-short": good[:39],
        "too-long": good + b"0",
        "empty": b"",
        "non-z85-char": b"~" + good[1:],
        "space-inside": good[:20] + b" " + good[21:],
        "hex-not-z85": b"ab" * 32,
    }


MALFORMED_IDS = ["too-short", "too-long", "empty", "non-z85-char", "space-inside", "hex-not-z85"]


@pytest.mark.parametrize("role", ["server", "client"])
@pytest.mark.parametrize("kind", MALFORMED_IDS)
def test_folder_malformed_key_is_a_value_error(
    tmp_path: Path, pairs: dict[str, tuple[bytes, bytes]], role: str, kind: str
) -> None:
    _write_keys(tmp_path, pairs)
    # server-public is read by both roles (the server's own key, the client's peer key).
    (tmp_path / "server-public").write_bytes(_malformed(pairs)[kind])
    with pytest.raises(ValueError, match="Z85"):
        load_curve_keys(role, str(tmp_path))


def test_folder_key_overflowing_z85_is_a_value_error(
    tmp_path: Path, pairs: dict[str, tuple[bytes, bytes]]
) -> None:
    _write_keys(tmp_path, pairs)
    (tmp_path / "server-public").write_bytes(b"#" * 40)
    with pytest.raises(ValueError):
        load_curve_keys("client", str(tmp_path))


# --- load_curve_keys from the environment ----------------------------------------------------


def _set_env(monkeypatch: pytest.MonkeyPatch, **values: bytes) -> None:
    for name, value in values.items():
        monkeypatch.setenv(f"COREFLEET_CURVE_{name.upper()}_KEY", value.decode())


@pytest.mark.parametrize("role", ["server", "client"])
def test_env_unset_means_no_curve(role: str) -> None:
    assert load_curve_keys(role) is None


def test_env_client_role(
    monkeypatch: pytest.MonkeyPatch, pairs: dict[str, tuple[bytes, bytes]]
) -> None:
    client_public, client_secret = pairs["client"]
    server_public, _ = pairs["server"]
    _set_env(monkeypatch, public=client_public, secret=client_secret, server=server_public)
    assert load_curve_keys("client") == CurveKeys(client_public, client_secret, server_public)


def test_env_server_role(
    monkeypatch: pytest.MonkeyPatch, pairs: dict[str, tuple[bytes, bytes]]
) -> None:
    server_public, server_secret = pairs["server"]
    client_public, _ = pairs["client"]
    _set_env(monkeypatch, public=server_public, secret=server_secret, client=client_public)
    assert load_curve_keys("server") == CurveKeys(server_public, server_secret, client_public)


@pytest.mark.parametrize(
    "role,present,missing",
    [
        ("client", ["public"], ["SECRET", "SERVER"]),
        ("client", ["secret"], ["PUBLIC", "SERVER"]),
        ("client", ["server"], ["PUBLIC", "SECRET"]),
        ("client", ["public", "secret"], ["SERVER"]),
        ("client", ["public", "server"], ["SECRET"]),
        ("client", ["secret", "server"], ["PUBLIC"]),
        # the server's peer variable does not stand in for the client's
        ("client", ["public", "secret", "client"], ["SERVER"]),
        ("server", ["public"], ["SECRET", "CLIENT"]),
        ("server", ["client"], ["PUBLIC", "SECRET"]),
        ("server", ["public", "secret"], ["CLIENT"]),
        ("server", ["secret", "client"], ["PUBLIC"]),
        ("server", ["public", "secret", "server"], ["CLIENT"]),
    ],
    ids=lambda v: "+".join(v) if isinstance(v, list) else v,
)
def test_env_half_configured_names_what_is_missing(
    monkeypatch: pytest.MonkeyPatch, role: str, present: list[str], missing: list[str]
) -> None:
    key = zmq.curve_keypair()[0]
    _set_env(monkeypatch, **dict.fromkeys(present, key))
    with pytest.raises(ValueError) as info:
        load_curve_keys(role)
    message = str(info.value)
    for name in missing:
        assert f"COREFLEET_CURVE_{name}_KEY" in message
    for name in present:
        assert f"COREFLEET_CURVE_{name.upper()}_KEY" not in message


def test_env_empty_value_counts_as_missing(
    monkeypatch: pytest.MonkeyPatch, pairs: dict[str, tuple[bytes, bytes]]
) -> None:
    client_public, _ = pairs["client"]
    server_public, _ = pairs["server"]
    _set_env(monkeypatch, public=client_public, secret=b"", server=server_public)
    with pytest.raises(ValueError, match="COREFLEET_CURVE_SECRET_KEY"):
        load_curve_keys("client")


def test_env_malformed_key_is_a_value_error(
    monkeypatch: pytest.MonkeyPatch, pairs: dict[str, tuple[bytes, bytes]]
) -> None:
    client_public, client_secret = pairs["client"]
    _set_env(monkeypatch, public=client_public, secret=client_secret, server=b"not-a-key")
    with pytest.raises(ValueError, match="Z85"):
        load_curve_keys("client")


def test_folder_wins_over_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pairs: dict[str, tuple[bytes, bytes]]
) -> None:
    _write_keys(tmp_path, pairs)
    other_public, other_secret = zmq.curve_keypair()
    _set_env(monkeypatch, public=other_public, secret=other_secret, server=other_public)
    keys = load_curve_keys("client", str(tmp_path))
    assert keys is not None
    assert keys.public_key == pairs["client"][0]
    assert keys.peer_key == pairs["server"][0]


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
