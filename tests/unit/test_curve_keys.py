"""load_curve_keys: CURVE keys from a folder (a mounted Secret) or the environment."""

from __future__ import annotations

from pathlib import Path

import pytest
import zmq

from corefleet.engine.transport.sockets import CurveKeys, load_curve_keys

ENV_VARS = (
    "COREFLEET_CURVE_PUBLIC_KEY",
    "COREFLEET_CURVE_SECRET_KEY",
    "COREFLEET_CURVE_SERVER_KEY",
    "COREFLEET_CURVE_CLIENT_KEY",
)


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
