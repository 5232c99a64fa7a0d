"""Wire codec: a registered frozen dataclass <-> ZeroMQ multipart frames, never pickle.

Frame 0 is an orjson header (the message's type tag and its fields); numpy arrays travel as
raw little-endian bytes after it, referenced from the header by frame index and byte offset.
Small arrays (up to PACK_LIMIT bytes) share one frame, each at an aligned offset: a step's
plan is then 2 frames instead of 12, and every frame costs each side of a socket a send or
receive call and its I/O thread a pass (a batch-1 plan encoded, sent, received and decoded
in one process: 254 -> 178 us).
Larger arrays (KV blocks) keep a frame of their own, sent without a copy. A dataclass field
left at its empty-array default is not sent at all. Decoding trusts nothing: unknown
types, unknown fields, a value that does not have its field's annotated type, dtypes
outside an allowlist, arrays that overlap, run past their frame or leave bytes of it unread
raise `ProtocolError`.
Owns: encoding rules and the type registry. Does not own: sockets (justapi/wire/transport.py).
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Callable, Sequence, TypeVar, Union

import numpy as np
import orjson

_REGISTRY: dict[str, type] = {}
_FIELD_CHECKS: dict[type, dict[str, tuple[Callable[[Any], bool], Any]]] = {}
_ALLOWED_DTYPES = {"<i4", "<i8", "<f4", "<f2", "|u1", "|b1", "<u4"}
_DTYPES = {name: np.dtype(name) for name in _ALLOWED_DTYPES}
_FRAME_KEY = "__frame__"
_OFFSET_KEY = "offset"
_TYPE_KEY = "__type__"
MAX_ARRAY_DIMS = 4
PACK_LIMIT = 64 << 10
"""Arrays up to this many bytes are copied into the message's shared frame; larger ones get
a frame of their own (zero-copy: the copy would cost more than the frame)."""
PACK_ALIGN = 16
_EMPTY_DEFAULTS: dict[type, dict[str, np.ndarray]] = {}

T = TypeVar("T")


class ProtocolError(ValueError):
    """A message that does not decode to a registered, well-formed dataclass. Where its
    header was a typed JSON object, `message_type` and `step_id` are what it said (not
    trusted: a receiver may only answer with them, e.g. a worker refusing a step)."""

    message_type: object = None
    step_id: object = None


def register(tag: str) -> Callable[[type[T]], type[T]]:
    """Class decorator: make a frozen dataclass encodable under a unique type tag."""

    def wrap(cls: type[T]) -> type[T]:
        if tag in _REGISTRY:
            raise RuntimeError(f"message tag {tag!r} registered twice")
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{cls.__name__} must be a dataclass")
        _REGISTRY[tag] = cls
        cls.TAG = tag  # type: ignore[attr-defined]
        return cls

    return wrap


class _Frames:
    """The frames of one message being encoded: the header's slot, then the shared frame of
    small arrays (made when the first one comes), then one frame per large array."""

    def __init__(self) -> None:
        self.frames: list[bytes | memoryview] = [b""]
        self.pack: list[bytes | memoryview] = []
        self.pack_index = 0
        self.pack_bytes = 0

    def add(self, array: np.ndarray) -> dict[str, Any]:
        ref: dict[str, Any] = {"dtype": array.dtype.str, "shape": list(array.shape)}
        data = memoryview(array).cast("B") if array.size else b""  # type: ignore[arg-type]
        if array.nbytes > PACK_LIMIT:
            self.frames.append(data)
            ref[_FRAME_KEY] = len(self.frames) - 1
            return ref
        if not self.pack_index:
            self.frames.append(b"")
            self.pack_index = len(self.frames) - 1
        pad = -self.pack_bytes % PACK_ALIGN
        if pad:
            self.pack.append(bytes(pad))
        ref[_FRAME_KEY], ref[_OFFSET_KEY] = self.pack_index, self.pack_bytes + pad
        self.pack.append(data)
        self.pack_bytes += pad + array.nbytes
        return ref

    def done(self, header: Any) -> list[bytes | memoryview]:
        self.frames[0] = orjson.dumps(header)
        if self.pack_index:
            self.frames[self.pack_index] = b"".join(self.pack)
        return self.frames


def encode(message: Any) -> list[bytes | memoryview]:
    """Message -> [header, array frames...]: small arrays copied into one shared frame, large
    ones sent without a copy when contiguous."""
    frames = _Frames()
    return frames.done(_encode_value(message, frames))


def decode(frames: Sequence[bytes | memoryview | Any]) -> Any:
    """[header, array frames...] -> message; raises ProtocolError on anything malformed."""
    if not frames:
        raise ProtocolError("empty message")
    buffers = [_as_buffer(f) for f in frames]
    try:
        header = orjson.loads(buffers[0])
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"header is not JSON: {exc}") from None
    if not isinstance(header, dict) or _TYPE_KEY not in header:
        raise ProtocolError("header is not a typed message")
    try:
        return _decode_message(header, buffers)
    except ProtocolError as exc:
        exc.message_type, exc.step_id = header.get(_TYPE_KEY), header.get("step_id")
        raise


def _decode_message(header: dict, buffers: list[memoryview]) -> Any:
    ends: dict[int, int] = {}  # frame -> end of the last array read from it
    message = _decode_value(header, buffers, ends, depth=0)
    if len(ends) != len(buffers) - 1:
        raise ProtocolError(f"message has {len(buffers) - 1} array frames, {len(ends)} used")
    for index, end in ends.items():
        if end != buffers[index].nbytes:
            raise ProtocolError(f"array frame {index} has {buffers[index].nbytes} bytes, its arrays "
                                f"end at {end}")
    return message


def _as_buffer(frame: Any) -> memoryview:
    if hasattr(frame, "buffer"):  # zmq.Frame
        return memoryview(frame.buffer)
    return memoryview(frame)


def _encode_value(value: Any, frames: _Frames) -> Any:
    if isinstance(value, np.ndarray):
        array = np.ascontiguousarray(value)
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        return frames.add(array)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        tag = getattr(type(value), "TAG", None)
        if tag is None:
            raise TypeError(f"{type(value).__name__} is not a registered message type")
        out = {_TYPE_KEY: tag}
        defaults = _empty_defaults(type(value))
        for field in dataclasses.fields(value):
            item = getattr(value, field.name)
            if field.name in defaults and _is_default(item, defaults[field.name]):
                continue  # the receiver's dataclass fills it in
            out[field.name] = _encode_value(item, frames)
        return out
    if isinstance(value, (list, tuple)):
        return [_encode_value(v, frames) for v in value]
    if isinstance(value, dict):
        return {str(k): _encode_value(v, frames) for k, v in value.items()}
    if isinstance(value, np.generic):
        return value.item()
    return value


def _empty_defaults(cls: type) -> dict[str, np.ndarray]:
    """The fields of `cls` whose default is an empty array, with that default."""
    defaults = _EMPTY_DEFAULTS.get(cls)
    if defaults is None:
        defaults = {}
        for field in dataclasses.fields(cls):
            factory = field.default_factory
            if factory is not dataclasses.MISSING:
                value = factory()
                if isinstance(value, np.ndarray) and value.size == 0:
                    defaults[field.name] = value
        _EMPTY_DEFAULTS[cls] = defaults
    return defaults


def _is_default(value: Any, default: np.ndarray) -> bool:
    return (isinstance(value, np.ndarray) and value.size == 0 and value.shape == default.shape
            and value.dtype == default.dtype)


def _decode_value(value: Any, buffers: list[memoryview], ends: dict[int, int], depth: int) -> Any:
    if depth > 8:
        raise ProtocolError("message nests too deeply")
    if isinstance(value, list):
        return [_decode_value(v, buffers, ends, depth + 1) for v in value]
    if not isinstance(value, dict):
        return value
    if _FRAME_KEY in value:
        return _decode_array(value, buffers, ends)
    if _TYPE_KEY in value:
        return _decode_dataclass(value, buffers, ends, depth)
    return {k: _decode_value(v, buffers, ends, depth + 1) for k, v in value.items()}


def _decode_dataclass(value: dict, buffers: list[memoryview], ends: dict[int, int], depth: int) -> Any:
    cls = _REGISTRY.get(value[_TYPE_KEY]) if isinstance(value[_TYPE_KEY], str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {value[_TYPE_KEY]!r}")
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, item in value.items():
        if key == _TYPE_KEY:
            continue
        if key not in names:
            raise ProtocolError(f"{cls.__name__} has no field {key!r}")
        kwargs[key] = _decode_value(item, buffers, ends, depth + 1)
    _check_field_types(cls, kwargs)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"bad {cls.__name__}: {exc}") from None


def _check_field_types(cls: type, kwargs: dict[str, Any]) -> None:
    """A peer could send any JSON value for any field: refuse one of the wrong type here, so
    no process ever works on a str where an int or an array belongs."""
    checks = _FIELD_CHECKS.get(cls)
    if checks is None:
        try:
            hints = typing.get_type_hints(cls)
        except (NameError, TypeError):  # an annotation we cannot resolve: the class checks it
            hints = {}
        checks = _FIELD_CHECKS[cls] = {name: (_make_check(hint), hint)
                                       for name, hint in hints.items()}
    for name, value in kwargs.items():
        check, hint = checks.get(name, (_accept, Any))
        if not check(value):
            raise ProtocolError(f"{cls.__name__}.{name} must be {_type_name(hint)}, got "
                                f"{type(value).__name__}")


def _has_type(value: Any, hint: Any) -> bool:
    """isinstance for the annotations messages use: int, float, str, bool, np.ndarray,
    dataclasses, X | None, list[X], tuple[X, ...], dict[K, V]; anything else is accepted."""
    return _make_check(hint)(value)


def _accept(value: Any) -> bool:
    return True


def _make_check(hint: Any) -> Callable[[Any], bool]:
    """_has_type's test for one annotation, worked out once per message field."""
    if hint is Any:
        return _accept
    origin = typing.get_origin(hint)
    if origin is Union or origin is types.UnionType:
        options = [_make_check(arg) for arg in typing.get_args(hint)]
        return lambda value: any(check(value) for check in options)
    if hint is float:
        return lambda value: isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return lambda value: isinstance(value, int) and not isinstance(value, bool)
    if origin in (list, tuple, set, frozenset):  # all travel as JSON arrays
        args = [a for a in typing.get_args(hint) if a is not Ellipsis]
        if len(set(args)) != 1:
            return lambda value: isinstance(value, list)
        item = _make_check(args[0])
        return lambda value: isinstance(value, list) and all(item(v) for v in value)
    if origin is dict:
        key_value = typing.get_args(hint)
        if len(key_value) != 2:
            return lambda value: isinstance(value, dict)
        entry = _make_check(key_value[1])
        return lambda value: isinstance(value, dict) and all(entry(v) for v in value.values())
    if hint in (list, tuple):
        return lambda value: isinstance(value, list)
    if isinstance(hint, type):
        return lambda value: isinstance(value, hint)
    return _accept  # Literal, TypeVar...: left to the class's own checks


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _decode_array(ref: dict, buffers: list[memoryview], ends: dict[int, int]) -> np.ndarray:
    """An array read in place from its frame; arrays of one frame must come in order, without
    overlapping (so no two alias the same bytes)."""
    index, dtype, shape = ref.get(_FRAME_KEY), ref.get("dtype"), ref.get("shape")
    offset = ref.get(_OFFSET_KEY, 0)
    if type(index) is not int or not 1 <= index < len(buffers):
        raise ProtocolError(f"bad array frame index {index!r}")
    if type(offset) is not int or offset < ends.get(index, 0):
        raise ProtocolError(f"bad array offset {offset!r} in frame {index} (arrays overlap or go back)")
    np_dtype = _DTYPES.get(dtype) if isinstance(dtype, str) else None
    if np_dtype is None:
        raise ProtocolError(f"array dtype {dtype!r} not allowed")
    if (not isinstance(shape, list) or len(shape) > MAX_ARRAY_DIMS
            or not all(isinstance(d, int) and d >= 0 for d in shape)):
        raise ProtocolError(f"bad array shape {shape!r}")
    count = math.prod(shape)
    end = offset + count * np_dtype.itemsize
    buffer = buffers[index]
    if end > buffer.nbytes:
        raise ProtocolError(f"array frame {index} has {buffer.nbytes} bytes, shape {shape} at "
                            f"offset {offset} needs {end}")
    ends[index] = end
    if not count:
        return np.empty(shape, dtype=np_dtype)
    array = np.frombuffer(buffer, dtype=np_dtype, count=count, offset=offset).reshape(shape)
    return array if array.flags.aligned else array.copy()
