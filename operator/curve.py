"""CURVE key pairs for the ZMQ sockets between the coordinator and the ranks.

The operator generates them once per InferenceEngine and stores them in a Secret (see
`resources.build_curve_secret`). ZMQ's CURVE is curve25519 (X25519) with keys written in Z85
(ZMQ RFC 32), 40 characters for 32 bytes, which is what `zmq.curve_keypair()` returns. The
operator image carries no pyzmq, so the keys come from `cryptography`'s X25519 and a small Z85
encoder here; a test checks both against pyzmq where it is installed.
"""

from __future__ import annotations

import dataclasses

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)

_Z85_ALPHABET = (
    "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
)


def z85_encode(data: bytes) -> str:
    """Encode bytes (a multiple of 4 long) in Z85, as ZMQ RFC 32 defines it."""
    if len(data) % 4:
        raise ValueError(f"Z85 needs a multiple of 4 bytes, got {len(data)}")
    out: list[str] = []
    for i in range(0, len(data), 4):
        value = int.from_bytes(data[i : i + 4], "big")
        chunk: list[str] = []
        for _ in range(5):
            value, digit = divmod(value, 85)
            chunk.append(_Z85_ALPHABET[digit])
        out.extend(reversed(chunk))
    return "".join(out)


@dataclasses.dataclass(frozen=True)
class CurveKeyPair:
    """One CURVE key pair, both halves Z85-encoded (40 characters each)."""

    public: str
    secret: str


@dataclasses.dataclass(frozen=True)
class CurveKeys:
    """The coordinator's (server) pair and the pair every rank of one engine uses (client)."""

    server: CurveKeyPair
    client: CurveKeyPair


def keypair_from_secret(secret: bytes) -> CurveKeyPair:
    """The CURVE pair for a 32-byte X25519 secret key."""
    private = X25519PrivateKey.from_private_bytes(secret)
    public = private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    raw_secret = private.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
    return CurveKeyPair(public=z85_encode(public), secret=z85_encode(raw_secret))


def generate_keypair() -> CurveKeyPair:
    """A fresh random CURVE pair (the OS random source, through `cryptography`)."""
    private = X25519PrivateKey.generate()
    return keypair_from_secret(
        private.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
    )


def generate_keys() -> CurveKeys:
    """Fresh server and client pairs for one InferenceEngine."""
    return CurveKeys(server=generate_keypair(), client=generate_keypair())
