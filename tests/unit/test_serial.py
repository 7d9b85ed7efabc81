"""The msgpack wire codec (engine/transport/serial.py): round trips, frame layout, zero copy."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import zmq

from corefleet.engine.transport.serial import ZERO_COPY_THRESHOLD, MsgpackDecoder, MsgpackEncoder
from tests.unit.serial_helpers import Carrier, assert_same_array, assert_same_tensor

# Any warning is a failure here: in particular torch's "buffer is not writable" warning, which the
# decoder must keep quiet when it builds tensors over read-only zmq frames.
pytestmark = pytest.mark.filterwarnings("error")


class TensorCarrier(msgspec.Struct):
    t: torch.Tensor
    rest: Any = None


def roundtrip(obj: Any, type_: Any = Any, threshold: int = ZERO_COPY_THRESHOLD) -> Any:
    frames = MsgpackEncoder(threshold).encode(obj)
    return MsgpackDecoder(type_).decode(frames)


def sample_arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    base = rng.standard_normal((20, 30)).astype(np.float32)
    return {
        "f32": rng.standard_normal((8, 16)).astype(np.float32),  # 512 B: aux
        "i64": np.arange(-50, 50, dtype=np.int64),  # 800 B: aux
        "bool": rng.random(37) > 0.5,  # 37 B: inline
        "u8": np.arange(256, dtype=np.uint8).reshape(16, 16),  # exactly 256 B: aux
        "u8_small": np.arange(10, dtype=np.uint8),
        "zero_d": np.array(3.5, dtype=np.float64),
        "empty": np.zeros((0, 4), dtype=np.float32),
        "strided": base[::2, 1::3],  # non-contiguous view
        "fortran": np.asfortranarray(base),
        "big_endian": np.arange(100, dtype=">i4"),
        "f16": np.linspace(0, 1, 7, dtype=np.float16),
    }


@pytest.mark.parametrize("name", list(sample_arrays()))
def test_struct_roundtrip_each_array(name: str) -> None:
    arr = sample_arrays()[name]
    msg = Carrier(a=arr, b={"x": arr, "n": 1}, c=[1, 2, 3])
    out = roundtrip(msg, Carrier)
    assert isinstance(out, Carrier)
    assert_same_array(out.a, arr)
    assert_same_array(out.b["x"], arr)
    assert out.b["n"] == 1
    assert out.c == [1, 2, 3]


def test_struct_roundtrip_all_arrays_at_once() -> None:
    arrays = sample_arrays()
    msg = Carrier(a=arrays["fortran"], b=list(arrays.values()), c=[])
    out = roundtrip(msg, Carrier)
    assert_same_array(out.a, arrays["fortran"])
    assert len(out.b) == len(arrays)
    for got, want in zip(out.b, arrays.values(), strict=True):
        assert_same_array(got, want)


def test_any_typed_values_come_back_as_arrays() -> None:
    big = np.arange(1000, dtype=np.int32)
    small = np.array([1.0, 2.0])
    obj = {"result": [big, {"nested": small}], "t": (1, "x")}
    out = roundtrip(obj)  # default type=Any
    assert_same_array(out["result"][0], big)
    assert_same_array(out["result"][1]["nested"], small)
    assert out["t"] == [1, "x"]
    # a top-level array with the default decoder, with and without aux frames
    assert_same_array(roundtrip(big), big)
    assert_same_array(MsgpackDecoder().decode(MsgpackEncoder().encode(small)[0]), small)


TENSORS = {
    "f32": torch.randn(16, 16, generator=torch.Generator().manual_seed(0)),
    "bf16": torch.randn(9, 33, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16),
    "bf16_small": torch.tensor([1.5, -2.25], dtype=torch.bfloat16),
    "i64": torch.arange(-100, 100, dtype=torch.int64),
    "bool": torch.arange(300) % 3 == 0,
    "empty": torch.zeros(0, 5, dtype=torch.bfloat16),
    "zero_d": torch.tensor(7, dtype=torch.int64),
    "transposed": torch.arange(600, dtype=torch.float32).reshape(20, 30).t(),
    "complex": torch.randn(40, dtype=torch.complex64, generator=torch.Generator().manual_seed(2)),
}


@pytest.mark.parametrize("name", list(TENSORS))
def test_tensor_roundtrip(name: str) -> None:
    t = TENSORS[name]
    out = roundtrip(TensorCarrier(t=t, rest=[t, {"k": t}]), TensorCarrier)
    assert_same_tensor(out.t, t)
    assert_same_tensor(out.rest[0], t)
    assert_same_tensor(out.rest[1]["k"], t)
    assert_same_tensor(roundtrip(t), t)


def test_tensor_requiring_grad_and_conj_are_sent_as_values() -> None:
    t = torch.randn(10, requires_grad=True)
    assert_same_tensor(roundtrip(t), t.detach())
    c = torch.randn(70, dtype=torch.complex64).conj()
    assert c.is_conj()
    assert_same_tensor(roundtrip(c), c.resolve_conj())


def test_field_type_mismatch_is_validation_error() -> None:
    frames = MsgpackEncoder().encode(TensorCarrier(t=torch.arange(3)))
    # an ndarray where a Struct field says torch.Tensor, and a list where it says ndarray
    with pytest.raises(msgspec.ValidationError):
        MsgpackDecoder(Carrier).decode(
            MsgpackEncoder().encode({"a": torch.arange(3), "b": 1, "c": []})
        )
    with pytest.raises(msgspec.ValidationError):
        MsgpackDecoder(Carrier).decode(MsgpackEncoder().encode({"a": [1, 2], "b": 1, "c": []}))
    with pytest.raises(msgspec.ValidationError):
        MsgpackDecoder(TensorCarrier).decode(
            MsgpackEncoder().encode({"t": np.arange(3), "rest": None})
        )
    assert_same_tensor(MsgpackDecoder(TensorCarrier).decode(frames).t, torch.arange(3))


def test_frame_count_large_arrays_aux_small_inline() -> None:
    large: list[Any] = [
        np.zeros(64, np.float32),
        np.ones(300, np.uint8),
        torch.arange(32, dtype=torch.int64),
    ]
    small: list[Any] = [np.arange(3), torch.ones(2)]
    frames = MsgpackEncoder(256).encode({"large": large, "small": small})
    assert len(frames) == 4
    assert [len(memoryview(f).cast("B")) for f in frames[1:]] == [256, 300, 256]
    # the small ones are inline: their bytes are inside the body
    assert np.arange(3).tobytes() in bytes(frames[0])
    out = MsgpackDecoder().decode(frames)
    assert_same_array(out["large"][0], large[0])
    assert_same_array(out["large"][1], large[1])
    assert_same_tensor(out["large"][2], large[2])
    assert_same_array(out["small"][0], small[0])
    assert_same_tensor(out["small"][1], small[1])
    # 255 B stays inline, 256 B does not
    assert len(MsgpackEncoder(256).encode(np.zeros(255, np.uint8))) == 1
    assert len(MsgpackEncoder(256).encode(np.zeros(256, np.uint8))) == 2
    # 0-d arrays are always inline
    assert len(MsgpackEncoder(0).encode(np.array(1.0))) == 1


def test_encoder_aux_frame_shares_memory_with_source() -> None:
    src = np.arange(1000, dtype=np.float64)
    frames = MsgpackEncoder().encode(src)
    assert len(frames) == 2
    assert np.shares_memory(np.frombuffer(frames[1], np.uint8), src)
    t = torch.arange(1000, dtype=torch.float32)
    tframes = MsgpackEncoder().encode(t)
    aux = np.frombuffer(tframes[1], np.uint8)
    assert np.shares_memory(aux, t.numpy())
    # mutating the source after encode shows through the frame: it is the same memory
    src[0] = 42.0
    assert np.frombuffer(frames[1], np.float64)[0] == 42.0


def test_decoder_aux_arrays_are_zero_copy() -> None:
    src = np.arange(500, dtype=np.int32)
    body, aux = MsgpackEncoder().encode(src)
    aux_buf = bytearray(aux)  # writable copy we can poke at
    out = MsgpackDecoder().decode([body, aux_buf])
    assert np.shares_memory(out, np.frombuffer(aux_buf, np.uint8))
    aux_buf[0:4] = np.int32(-7).tobytes()
    assert out[0] == -7
    # torch tensors too
    t = torch.arange(200, dtype=torch.float32)
    tbody, taux = MsgpackEncoder().encode(t)
    taux_buf = bytearray(taux)
    tout = MsgpackDecoder().decode([tbody, taux_buf])
    taux_buf[0:4] = np.float32(9.5).tobytes()
    assert tout[0].item() == 9.5
    # read-only frames (bytes) are fine
    ro = MsgpackDecoder().decode([body, bytes(aux)])
    assert_same_array(ro, np.arange(500, dtype=np.int32))
    assert not ro.flags.writeable
    # a tensor over a read-only frame: no "not writable" warning (warnings are errors here)
    tro = MsgpackDecoder().decode([tbody, bytes(taux)])
    assert_same_tensor(tro, torch.arange(200, dtype=torch.float32))


def test_inline_arrays_do_not_alias_the_body() -> None:
    small = np.arange(5, dtype=np.int64)
    buf = bytearray()
    enc, dec = MsgpackEncoder(), MsgpackDecoder()
    out = dec.decode(enc.encode_into(small, buf))
    buf[:] = b"\x00" * len(buf)  # reuse / clobber the body
    assert_same_array(out, small)
    out[0] = 100  # inline arrays own writable memory
    assert out[0] == 100


def test_encode_into_reuses_buffer() -> None:
    enc, dec = MsgpackEncoder(), MsgpackDecoder(Carrier)
    buf = bytearray()
    long_msg = Carrier(a=np.arange(50, dtype=np.uint8), b="x" * 500, c=list(range(100)))
    frames1 = enc.encode_into(long_msg, buf)
    assert frames1[0] is buf
    assert len(frames1) == 1
    first_len = len(buf)
    out1 = dec.decode(frames1)
    assert out1.b == "x" * 500
    assert out1.c == list(range(100))
    short_msg = Carrier(a=np.arange(300, dtype=np.uint8), b=None, c=[7])
    frames2 = enc.encode_into(short_msg, buf)
    assert frames2[0] is buf
    assert len(frames2) == 2  # 300 B array went to an aux frame
    assert len(buf) < first_len  # truncated, no stale tail
    assert bytes(buf) == enc.encode(short_msg)[0]
    out2 = dec.decode(frames2)
    assert_same_array(out2.a, short_msg.a)
    assert out2.b is None
    assert out2.c == [7]


def test_over_real_zmq() -> None:
    ctx = zmq.Context()
    a = ctx.socket(zmq.PAIR)
    b = ctx.socket(zmq.PAIR)
    a.setsockopt(zmq.LINGER, 0)
    b.setsockopt(zmq.LINGER, 0)
    try:
        port = a.bind_to_random_port("tcp://127.0.0.1")
        b.connect(f"tcp://127.0.0.1:{port}")
        b.setsockopt(zmq.RCVTIMEO, 10_000)
        arr = np.random.default_rng(3).standard_normal((64, 64)).astype(np.float32)
        tensor = torch.randn(32, 48).to(torch.bfloat16)
        msg = Carrier(a=arr, b={"t": tensor, "small": np.arange(4)}, c=[1, 2])
        enc, dec = MsgpackEncoder(), MsgpackDecoder(Carrier)
        buf = bytearray()
        frames = enc.encode_into(msg, buf)
        assert len(frames) == 3
        a.send_multipart(frames, copy=False)
        received = b.recv_multipart(copy=False)
        assert all(isinstance(f, zmq.Frame) for f in received)
        out = dec.decode(received)
        assert_same_array(out.a, arr)
        assert_same_tensor(out.b["t"], tensor)
        assert_same_array(out.b["small"], np.arange(4))
        assert out.c == [1, 2]
        # and a single-frame message given as one zmq.Frame
        a.send_multipart(enc.encode([1, "x"]), copy=False)
        one = b.recv_multipart(copy=False)
        assert len(one) == 1
        assert MsgpackDecoder(list[Any]).decode(one[0]) == [1, "x"]
    finally:
        a.close(linger=0)
        b.close(linger=0)
        ctx.term()
