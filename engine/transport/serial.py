"""msgpack wire codec (msgspec) for the ZMQ messages between the engine process and its clients.

A message is a list of frames: frame 0 is the msgpack body, frames 1.. are auxiliary frames that
carry the raw bytes of large numpy arrays / torch tensors without copying them on either end.
Nothing is ever pickled.

Arrays are self-describing msgpack Ext values, so they decode correctly anywhere, including inside
``Any``-typed fields (a utility call's result, say):

* Ext code 1 = numpy ndarray, Ext code 2 = torch tensor.
* Ext payload = msgpack array ``[dtype_name, shape, data]``: ``dtype_name`` is ``ndarray.dtype.str``
  (``"<f4"``) or the torch dtype without ``"torch."`` (``"bfloat16"``); ``shape`` is a list of
  ints; ``data`` is either the C-order bytes (inline: 0-d arrays and arrays with
  ``nbytes < size_threshold``) or an int index into the whole frame list, so ``1`` is the first
  auxiliary frame (``frames[1]``); index 0, the body itself, is never valid.

Exception contract of :meth:`MsgpackDecoder.decode`: malformed input of any kind (garbage or
truncated msgpack, nesting too deep, unknown Ext code, bad Ext payload, bad dtype, aux index out of
range, data size not matching dtype x shape, negative dims) raises ``msgspec.DecodeError``; data
that is well formed but does not match the decoder's type raises ``msgspec.ValidationError``, a
subclass of ``DecodeError``. ``DecodeError`` is itself a subclass of both ``msgspec.MsgspecError``
and ``ValueError``. Only a wrong argument type (not a buffer / sequence of buffers) is a TypeError.
:meth:`MsgpackEncoder.encode` raises ``TypeError`` for any value it cannot encode.
"""

from __future__ import annotations

import math
import re
import sys
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeAlias, TypeVar, get_origin, overload

import msgspec
import numpy as np

if TYPE_CHECKING:
    from types import ModuleType

    import zmq
    from typing_extensions import Buffer

__all__ = ["ZERO_COPY_THRESHOLD", "MsgpackDecoder", "MsgpackEncoder"]

ZERO_COPY_THRESHOLD = 256
"""Arrays / tensors with at least this many bytes travel as auxiliary frames; smaller ones inline.
Below this size a separate ZMQ frame costs more than copying the bytes into the body."""

_NDARRAY_EXT = 1
_TENSOR_EXT = 2

T = TypeVar("T")
Frame: TypeAlias = bytes | bytearray | memoryview

# What ``data`` in an Ext payload decodes to: inline bytes as a private bytearray (so small decoded
# arrays own writable memory and never alias a buffer the caller may reuse) or an aux frame index.
_Payload = tuple[str, tuple[int, ...], bytearray | int]

# ``ndarray.dtype.str`` forms we accept: byte-order char, kind, item size, optional datetime unit.
# Matching this *before* calling np.dtype keeps arbitrary strings (structured specs, deprecated
# aliases that warn) away from numpy's dtype parser. Kinds O (object) and V (void) never pass.
_NP_DTYPE_RE = re.compile(r"[<>|][biufcmMSU][0-9]{1,9}(\[[0-9]{0,9}[a-zA-Z]{1,2}\])?")

# torch dtypes without a plain bytes representation (quantized: scale/zero point live outside the
# storage; bits*: opaque) are refused on both ends. Viewing uint8 bytes as them "works" in torch
# and yields a broken tensor, so this is an allowlist rather than relying on torch to complain.
_TORCH_DTYPE_PREFIXES = ("float", "bfloat", "complex", "int", "uint", "bool")
_TORCH_NOT_WRITABLE = "The given buffer is not writable"


def _torch_dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


class MsgpackEncoder:
    """Encodes a msgspec-encodable object, numpy arrays and torch tensors anywhere inside it, into
    ``[body, *aux_frames]`` for ``socket.send_multipart(frames, copy=False)``.

    Aux frames are memoryviews of the arrays' own memory (or of a contiguous copy for strided or
    non-CPU data): the caller must not mutate those arrays until ZMQ has sent the frames.
    Not thread-safe (the aux frame list of the message being encoded lives on the instance): use
    one encoder per thread.
    """

    def __init__(self, size_threshold: int = ZERO_COPY_THRESHOLD) -> None:
        self.size_threshold = size_threshold
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._payload_encoder = msgspec.msgpack.Encoder()
        self._frames: list[Frame] = []

    def encode(self, obj: Any) -> list[Frame]:
        """Return ``[body, *aux]``; body is a fresh ``bytes``."""
        frames: list[Frame] = [b""]
        self._frames = frames
        try:
            frames[0] = self._encoder.encode(obj)
        finally:
            self._frames = []
        return frames

    def encode_into(self, obj: Any, buf: bytearray) -> list[Frame]:
        """Like :meth:`encode` but writes the body into ``buf`` (overwritten and truncated to the
        message, so no stale tail survives) and returns ``buf`` itself as frame 0. Do not reuse
        ``buf`` while a previous zero-copy send of it may still be in flight."""
        frames: list[Frame] = [buf]
        self._frames = frames
        try:
            self._encoder.encode_into(obj, buf)
        finally:
            self._frames = []
        return frames

    def _enc_hook(self, obj: Any) -> Any:
        # msgspec calls this only for types it cannot encode natively.
        if isinstance(obj, np.ndarray):
            return self._encode_ndarray(obj)
        torch = sys.modules.get("torch")  # importing torch here would cost seconds and need it
        if torch is not None and isinstance(obj, torch.Tensor):
            return self._encode_tensor(obj, torch)
        if isinstance(obj, np.generic):
            raise TypeError(
                f"cannot serialize numpy scalar {type(obj).__name__}: use .item() or a 0-d array"
            )
        raise TypeError(
            f"cannot serialize object of type {type(obj).__module__}.{type(obj).__qualname__}"
        )

    def _encode_ndarray(self, arr: np.ndarray) -> msgspec.msgpack.Ext:
        if isinstance(arr, np.ma.MaskedArray):
            raise TypeError("cannot serialize numpy masked arrays (the mask would be lost)")
        if arr.dtype.kind in "OV" or arr.dtype.hasobject:
            raise TypeError(f"cannot serialize numpy array of dtype {arr.dtype} (object/void)")
        # asarray drops ndarray subclasses (np.matrix would keep 2-D through reshape(-1)); strided
        # and Fortran-order arrays become one C-order copy, contiguous ones are not copied.
        arr = np.asarray(arr)
        if not arr.flags.c_contiguous:
            arr = arr.copy(order="C")
        return msgspec.msgpack.Ext(_NDARRAY_EXT, self._payload(arr.dtype.str, arr.shape, arr))

    def _encode_tensor(self, t: Any, torch: ModuleType) -> msgspec.msgpack.Ext:
        name = _torch_dtype_name(t.dtype)
        if t.layout != torch.strided or t.is_quantized or t.is_meta:
            raise TypeError(f"cannot serialize {t.layout} / quantized / meta torch tensors")
        if not name.startswith(_TORCH_DTYPE_PREFIXES):
            raise TypeError(f"cannot serialize torch tensor of dtype {t.dtype}")
        # resolve_conj/neg: .numpy() refuses tensors carrying the lazy conjugate/negative bits.
        t = t.detach().resolve_conj().resolve_neg().contiguous().cpu()
        # bfloat16 & co have no numpy dtype: expose the storage as raw uint8 instead. reshape(-1)
        # first because view(dtype) with another item size is not allowed on 0-d tensors.
        raw = t.reshape(-1).view(torch.uint8).numpy()
        return msgspec.msgpack.Ext(_TENSOR_EXT, self._payload(name, tuple(t.shape), raw))

    def _payload(self, dtype: str, shape: tuple[int, ...], arr: np.ndarray) -> bytes:
        data: bytes | int
        if arr.nbytes < self.size_threshold or not shape:
            data = arr.tobytes()
        else:
            # Flat uint8 view: a 1-D byte buffer for ZMQ whatever the dtype (datetime arrays do
            # not even export a buffer). The memoryview keeps the source array alive.
            data = len(self._frames)
            self._frames.append(arr.reshape(-1).view(np.uint8).data)
        return self._payload_encoder.encode((dtype, shape, data))


def _dec_hook(type_: Any, obj: Any) -> Any:
    # msgspec calls this for fields annotated with a type it does not know (np.ndarray,
    # torch.Tensor, npt.NDArray[...]) with the value as already decoded, i.e. after the Ext hook.
    # Convert nothing: a list where an array is expected is a validation error. ValueError and
    # TypeError raised here become msgspec.ValidationError with the field path.
    cls = get_origin(type_) or type_
    if isinstance(cls, type) and isinstance(obj, cls):
        return obj
    raise TypeError(f"Expected `{getattr(cls, '__name__', cls)}`, got `{type(obj).__name__}`")


class MsgpackDecoder(Generic[T]):
    """Decodes what :class:`MsgpackEncoder` produced into ``type`` (default ``Any``).

    ``decode`` takes one buffer (no aux frames) or a sequence ``[body, *aux]`` of buffers: bytes,
    bytearray, memoryview or ``zmq.Frame`` from ``recv_multipart(copy=False)``. Large arrays are
    built over the aux frames without copying and keep the frames alive: read-only over bytes,
    writable over a ``zmq.Frame`` or bytearray (writes land in the frame). Small (inline) arrays
    own their memory.
    Raises ``msgspec.DecodeError`` (``ValidationError`` for type mismatches) on any bad input; see
    the module docstring. Not thread-safe (the frames being decoded live on the instance).
    """

    @overload
    def __init__(self: MsgpackDecoder[Any]) -> None: ...
    @overload
    def __init__(self, type: type[T]) -> None: ...
    def __init__(self, type: Any = Any) -> None:
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(
            type, ext_hook=self._ext_hook, dec_hook=_dec_hook
        )
        self._payload_decoder = msgspec.msgpack.Decoder(_Payload)
        self._frames: Sequence[Buffer] = ()

    def decode(self, frames: Buffer | zmq.Frame | Sequence[Buffer | zmq.Frame]) -> T:
        try:
            body = memoryview(frames)  # type: ignore[arg-type]
            seq: Sequence[Buffer] = ()
        except TypeError:  # not a buffer: a sequence of frames
            # zmq.Frame has the buffer protocol; its type stubs do not declare it.
            seq = frames  # type: ignore[assignment]
            if len(seq) == 0:
                raise msgspec.DecodeError("no frames to decode") from None
            body = memoryview(seq[0])
        self._frames = seq
        try:
            return self._decoder.decode(body)
        except RecursionError as e:
            # msgspec lets deeply nested input raise RecursionError: keep the contract.
            raise msgspec.DecodeError("msgpack input nested too deeply") from e
        finally:
            self._frames = ()

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        # ``data`` is a view into the body; nothing decoded here may keep referencing it.
        # msgspec propagates exceptions from this hook unchanged (a KeyError stays a KeyError), so
        # every failure is turned into DecodeError here.
        if code not in (_NDARRAY_EXT, _TENSOR_EXT):
            raise msgspec.DecodeError(f"unknown msgpack ext type {code}")
        try:
            dtype_name, shape, data_ref = self._payload_decoder.decode(data)
        except msgspec.DecodeError as e:  # say where: msgspec's own path would point at "$"
            raise msgspec.DecodeError(f"bad payload in ext type {code}: {e}") from e
        try:
            if code == _NDARRAY_EXT:
                return self._decode_ndarray(dtype_name, shape, data_ref)
            return self._decode_tensor(dtype_name, shape, data_ref)
        except msgspec.DecodeError:
            raise
        except (ValueError, TypeError, RuntimeError) as e:
            raise msgspec.DecodeError(f"bad array in ext type {code}: {e}") from e

    def _data(self, shape: tuple[int, ...], itemsize: int, ref: bytearray | int) -> Frame:
        """The array's bytes, checked to be exactly dtype x shape."""
        if any(d < 0 for d in shape):
            raise msgspec.DecodeError(f"negative dimension in shape {shape}")
        buf: Frame
        if isinstance(ref, int):
            if not 1 <= ref < len(self._frames):
                raise msgspec.DecodeError(
                    f"aux frame index {ref} out of range ({len(self._frames)} frames)"
                )
            buf = memoryview(self._frames[ref])
            if buf.ndim != 1 or buf.itemsize != 1:
                buf = buf.cast("B")
        else:
            buf = ref
        expected = math.prod(shape) * itemsize
        if len(buf) != expected:
            raise msgspec.DecodeError(
                f"array data is {len(buf)} bytes, shape {shape} x itemsize {itemsize} needs "
                f"{expected}"
            )
        return buf

    def _decode_ndarray(self, name: str, shape: tuple[int, ...], ref: bytearray | int) -> Any:
        if not _NP_DTYPE_RE.fullmatch(name):
            raise msgspec.DecodeError(f"bad numpy dtype {name!r}")
        dtype = np.dtype(name)
        if dtype.str != name or dtype.hasobject or dtype.itemsize == 0:
            raise msgspec.DecodeError(f"bad numpy dtype {name!r}")
        buf = self._data(shape, dtype.itemsize, ref)
        # Zero copy: the array references the aux frame (or the private inline bytearray).
        return np.frombuffer(buf, dtype).reshape(shape)

    def _decode_tensor(self, name: str, shape: tuple[int, ...], ref: bytearray | int) -> Any:
        try:
            import torch  # lazily: processes that never receive tensors need not have torch
        except ImportError as e:
            raise msgspec.DecodeError("received a torch tensor but torch is not installed") from e
        dtype = getattr(torch, name, None) if name.startswith(_TORCH_DTYPE_PREFIXES) else None
        # The name must be canonical: no aliases (half), no arbitrary torch attributes.
        if not isinstance(dtype, torch.dtype) or _torch_dtype_name(dtype) != name:
            raise msgspec.DecodeError(f"bad torch dtype {name!r}")
        buf = self._data(shape, dtype.itemsize, ref)
        if len(buf) == 0:  # torch.frombuffer refuses empty buffers
            return torch.empty(shape, dtype=dtype)
        if isinstance(buf, memoryview) and buf.readonly:
            # Read-only frames (bytes; zmq.Frame is writable) are fine here, but torch warns about
            # them. The filter matches only that message so unrelated warnings stay visible.
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_TORCH_NOT_WRITABLE)
                flat = torch.frombuffer(buf, dtype=torch.uint8)
        else:
            flat = torch.frombuffer(buf, dtype=torch.uint8)
        return flat.view(dtype).reshape(shape)
