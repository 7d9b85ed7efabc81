"""CURVE keys: Z85 and X25519 as ZMQ expects them."""

from __future__ import annotations

import pytest

from corefleet.operator.curve import generate_keys, keypair_from_secret, z85_encode

# RFC 7748 section 6.1, Alice's key pair.
ALICE_SECRET = bytes.fromhex("77076d0a7318a57d3c16c17251b26645df4c2f87ebc0992ab177fba51db92c2a")
ALICE_PUBLIC = bytes.fromhex("8520f0098930a754748b7ddcb43ef75a0dbf3a0d26381af4eba4a98eaa9b4e6a")


def test_z85_matches_the_zmq_rfc_vector():
    assert z85_encode(bytes([0x86, 0x4F, 0xD2, 0x6F, 0xB5, 0x59, 0xF7, 0x5B])) == "HelloWorld"
    assert z85_encode(b"") == ""
    with pytest.raises(ValueError, match="multiple of 4"):
        z85_encode(b"abc")


def test_public_key_is_x25519_of_the_secret():
    pair = keypair_from_secret(ALICE_SECRET)
    assert pair.public == z85_encode(ALICE_PUBLIC)
    assert pair.secret == z85_encode(ALICE_SECRET)
    assert len(pair.public) == len(pair.secret) == 40


def test_generated_keys_are_fresh_and_well_formed():
    a, b = generate_keys(), generate_keys()
    values = {a.server.public, a.server.secret, a.client.public, a.client.secret, b.server.public}
    assert len(values) == 5 and all(len(v) == 40 for v in values)


def test_pyzmq_accepts_the_keys():
    zmq = pytest.importorskip("zmq", reason="pyzmq is only in the engine extra")
    if not zmq.has("curve"):
        pytest.skip("this libzmq has no CURVE support")
    keys = generate_keys()
    assert zmq.curve_public(keys.server.secret.encode()) == keys.server.public.encode()
    assert zmq.curve_public(keys.client.secret.encode()) == keys.client.public.encode()
