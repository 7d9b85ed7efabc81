"""The msgpack codec refuses what it cannot carry: unsupported types and malformed frames."""

from __future__ import annotations

import random
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from corefleet.engine.transport.serial import MsgpackDecoder, MsgpackEncoder
from tests.unit.serial_helpers import Carrier, assert_same_array

DECODE_ERRORS = (msgspec.MsgspecError, ValueError, TypeError)

# Any warning is a failure here: in particular torch's "buffer is not writable" warning, which the
# decoder must keep quiet when it builds tensors over read-only zmq frames.
pytestmark = pytest.mark.filterwarnings("error")


class NotSerializable:
    pass


@pytest.mark.parametrize(
    "obj",
    [
        object(),
        NotSerializable(),
        lambda: 1,
        {"k": [1, NotSerializable()]},
        np.float32(1.0),
        np.array([object(), 1], dtype=object),
        np.zeros(3, dtype=[("x", np.int32), ("y", np.float32)]),  # void (structured)
        np.ma.masked_array([1, 2], mask=[False, True]),
        torch.zeros(3, dtype=torch.float32).to_sparse(),
    ],
    ids=lambda o: type(o).__name__,
)
def test_unsupported_types_raise_type_error(obj: Any) -> None:
    enc = MsgpackEncoder()
    with pytest.raises(TypeError):
        enc.encode(obj)
    with pytest.raises(TypeError):
        enc.encode_into(obj, bytearray())
    # the encoder is still usable and carries no leftover aux frames afterwards
    assert len(enc.encode(np.zeros(1000))) == 2


def ext_message(code: int, payload: Any, aux: list[bytes] | None = None) -> list[Any]:
    data = payload if isinstance(payload, bytes) else msgspec.msgpack.encode(payload)
    return [msgspec.msgpack.encode({"x": msgspec.msgpack.Ext(code, data)}), *(aux or [])]


def index_zero_message() -> list[Any]:
    """A message whose Ext payload points at frame 0 (the body) and whose shape matches the
    body's length exactly, so only the index check can reject it."""
    n = 0
    for _ in range(10):
        body = ext_message(1, ["|u1", [n], 0])[0]
        if len(body) == n:
            return [body]
        n = len(body)
    raise AssertionError("no fixed point")


MALFORMED = {
    "random_bytes": [b"\xc1\xff\x00garbage"],
    "empty": [b""],
    "no_frames": [],
    "truncated": [MsgpackEncoder().encode({"a": np.arange(3), "s": "hello"})[0][:-3]],
    "aux_missing": MsgpackEncoder().encode(np.arange(100))[:1],
    "aux_index_zero": index_zero_message(),
    "aux_index_negative": ext_message(1, ["<i8", [1], -1], [b"\x00" * 8]),
    "size_mismatch_inline": ext_message(1, ["<f4", [3], b"\x00" * 11]),
    "size_too_large_inline": ext_message(1, ["<f4", [2, 2], b"\x00" * 20]),
    "size_mismatch_aux": ext_message(1, ["<f4", [4, 4], 1], [b"\x00" * 60]),
    "tensor_size_mismatch": ext_message(2, ["bfloat16", [3], b"\x00" * 5]),
    "negative_shape": ext_message(1, ["<f4", [-1, -4], b"\x00" * 16]),
    "huge_shape": ext_message(1, ["<f4", [2**62, 2**62, 0], b""]),
    "dim_overflow": ext_message(1, ["<f4", [0, 2**64 - 1], b""]),
    "tensor_dim_overflow": ext_message(2, ["float32", [0, 2**63], b""]),
    "too_many_dims": ext_message(1, ["|u1", [1] * 100, b"\x00"]),
    "unknown_ext": [msgspec.msgpack.encode({"x": msgspec.msgpack.Ext(99, b"abc")})],
    "payload_not_msgpack": ext_message(1, b"\xc1\xc1"),
    "payload_wrong_structure": ext_message(1, {"dtype": "<f4"}),
    "payload_wrong_arity": ext_message(1, ["<f4", [1]]),
    "payload_shape_not_ints": ext_message(1, ["<f4", ["a"], b"\x00" * 4]),
    "bad_dtype": ext_message(1, ["float99", [1], b"\x00" * 4]),
    "object_dtype": ext_message(1, ["|O8", [1], b"\x00" * 8]),
    "void_dtype": ext_message(1, ["|V4", [1], b"\x00" * 4]),
    "structured_dtype": ext_message(1, ["i4,f4", [1], b"\x00" * 8]),
    "non_canonical_dtype": ext_message(1, ["float32", [1], b"\x00" * 4]),
    "non_canonical_byte_order": ext_message(1, ["|f4", [1], b"\x00" * 4]),
    "bad_torch_dtype": ext_message(2, ["Tensor", [1], b"\x00" * 4]),
    "torch_alias_dtype": ext_message(2, ["half", [1], b"\x00" * 2]),
    "torch_quantized_dtype": ext_message(2, ["qint8", [1], b"\x00"]),
    "nested_too_deep": [b"\x91" * 100_000 + b"\x00"],
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_input_raises_decode_error(name: str) -> None:
    dec = MsgpackDecoder()
    with pytest.raises(msgspec.DecodeError):
        dec.decode(MALFORMED[name])
    # the decoder is still usable afterwards
    assert_same_array(dec.decode(MsgpackEncoder().encode(np.arange(100))), np.arange(100))


def test_fuzz_never_raises_anything_else() -> None:
    rnd = random.Random(1234)
    msg = Carrier(
        a=np.arange(40, dtype=np.float32),
        b={"t": torch.arange(100, dtype=torch.int64), "s": np.arange(6).reshape(2, 3), "x": "y"},
        c=[1, 2, 3],
    )
    body, *aux = MsgpackEncoder().encode(msg)
    body = bytes(body)
    decoders: list[MsgpackDecoder[Any]] = [MsgpackDecoder(), MsgpackDecoder(Carrier)]
    outcomes = {"ok": 0, "error": 0}
    for i in range(2000):
        if i % 4 == 0:
            data = bytes(rnd.randrange(256) for _ in range(rnd.randrange(1, 64)))
        else:
            mutated = bytearray(body)
            for _ in range(rnd.randrange(1, 4)):
                mutated[rnd.randrange(len(mutated))] = rnd.randrange(256)
            if i % 7 == 0:
                mutated = mutated[: rnd.randrange(len(mutated))]
            data = bytes(mutated)
        frames = [data, *aux] if i % 3 else [data]
        try:
            decoders[i % 2].decode(frames)
            outcomes["ok"] += 1
        except DECODE_ERRORS:
            outcomes["error"] += 1
    # both branches are exercised, so the loop is not vacuous
    assert outcomes["ok"] > 0
    assert outcomes["error"] > 0


def test_dtype_strings_matching_the_pattern_never_escape() -> None:
    # every kind/size/order/unit combination the decoder's dtype pattern lets through to numpy:
    # each one either decodes to exactly that dtype or raises DecodeError (no warning, no other
    # exception)
    dec = MsgpackDecoder()
    accepted = set()
    for kind in "biufcmMSU":
        for size in (0, 1, 2, 3, 4, 8, 16, 99):
            for order in "<>|":
                for unit in ("", "[ns]", "[D]", "[xx]", "[25s]"):
                    name = f"{order}{kind}{size}{unit}"
                    try:
                        out = dec.decode(ext_message(1, [name, [0], b""]))["x"]
                    except msgspec.DecodeError:
                        continue
                    assert out.dtype.str == name
                    assert out.shape == (0,)
                    accepted.add(name)
    assert {"<f4", ">f8", "|b1", "|u1", "<i8", "<M8[ns]", "<m8[25s]", "<U3", "|S2"} <= accepted
    assert not {"|f4", "<b1", "|S0", "<M8[xx]"} & accepted
