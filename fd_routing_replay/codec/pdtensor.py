"""FastDeploy's ``.pdtensor`` routing files: written without Paddle, read without unpickling.

FastDeploy's local routing store saves each routing array with ``paddle.save(array, path)``.
For a NumPy array that is exactly ``pickle.dumps(array, protocol=4)``: Paddle's pickler
only adds reducers for its own tensor types.  :func:`encode_pdtensor` produces the same
bytes from NumPy and the pickle module's *writing* side (tested byte for byte against
``paddle.save``).

:func:`decode_pdtensor` never unpickles: it walks the stream with
:func:`pickletools.genops`, which only tokenises, and accepts nothing but the opcode
sequence that pickling one C-ordered uint8/uint16/uint32/int64 array of 2 or 3 dimensions
produces (``numpy._core.multiarray._reconstruct`` or NumPy 1's ``numpy.core.multiarray``,
``numpy.ndarray``, ``numpy.dtype``, the array's state).  Anything else — another global,
another opcode, a dtype, byte order or byte count that does not fit — is a
:class:`~fd_routing_replay.errors.RecordError` naming the source and what was unexpected.
The array returned is a read-only zero-copy view on the caller's buffer.
"""

from __future__ import annotations

import io
import math
import pickle
import pickletools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from fd_routing_replay.codec.header import byte_view
from fd_routing_replay.codec.record import RecordFormat, RoutingRecord
from fd_routing_replay.errors import RecordError

__all__ = [
    "FASTDEPLOY_DTYPES", "PDTENSOR_SUFFIX", "PICKLE_PROTOCOL", "PdTensor", "decode_pdtensor",
    "encode_pdtensor", "fastdeploy_fill", "looks_like_pdtensor", "pad_tokens", "record_from_pdtensor",
    "trim_padding",
]

PDTENSOR_SUFFIX = ".pdtensor"
PICKLE_PROTOCOL = 4
"""``paddle.save``'s default protocol, the one FastDeploy uses."""

FASTDEPLOY_DTYPES: dict[str, np.dtype] = {
    "uint8": np.dtype("u1"),
    "uint16": np.dtype("<u2"),
    "uint32": np.dtype("<u4"),
    "int64": np.dtype("<i8"),  # FastDeploy's routing debug mode
}
"""What FastDeploy can write: its routing dtype rule, plus int64 in debug mode."""

_BY_CODE = {dt.str[1:]: dt for dt in FASTDEPLOY_DTYPES.values()}  # "u1" -> dtype
_RECONSTRUCT_MODULES = ("numpy._core.multiarray", "numpy.core.multiarray")  # NumPy 2 / 1
_MAX_OPCODES = 128  # the accepted stream has about 60; bounds work on hostile input
_INT_OPCODES = ("BININT1", "BININT2", "BININT", "LONG1")
_BYTES_HEADER = {"SHORT_BINBYTES": 1, "BINBYTES": 4, "BINBYTES8": 8}  # opcode -> length bytes
_PROTO_PREFIX = bytes((pickle.PROTO[0], PICKLE_PROTOCOL))


def fastdeploy_fill(dtype: np.dtype) -> int:
    """FastDeploy's "no routing" value: ``-1`` cast to ``dtype`` (the max of an unsigned type)."""
    dtype = np.dtype(dtype)
    return int(np.iinfo(dtype).max) if dtype.kind == "u" else -1


def _check_dtype(dtype: np.dtype, what: str) -> np.dtype:
    if dtype.str[1:] not in _BY_CODE or (dtype.itemsize > 1 and dtype.byteorder == ">"):
        raise RecordError(f"{what}: dtype {dtype} ({dtype.str}) is not one FastDeploy writes; "
                          f"use one of {', '.join(FASTDEPLOY_DTYPES)} (little-endian)")
    return _BY_CODE[dtype.str[1:]]


def encode_pdtensor(array: np.ndarray) -> bytes:
    """The bytes ``paddle.save(array, path)`` writes for ``array`` with the same NumPy,
    built without Paddle (NumPy's own reducer and the pickle module's writing side).

    ``array`` is FastDeploy's ``[max_model_len, top_k]`` (per layer) or
    ``[layers, max_model_len, top_k]`` (fused) array of a dtype in
    :data:`FASTDEPLOY_DTYPES`; it is written C-ordered and little-endian.
    """
    if not isinstance(array, np.ndarray):
        raise RecordError(f".pdtensor: expected a numpy array, got {type(array).__name__}")
    if array.ndim not in (2, 3):
        raise RecordError(f".pdtensor: FastDeploy writes 2-D [tokens, top_k] or 3-D "
                          f"[layers, tokens, top_k] arrays, got shape {array.shape}")
    dtype = _check_dtype(array.dtype, ".pdtensor")
    array = np.ascontiguousarray(array, dtype=dtype)
    return pickle.dumps(array, protocol=PICKLE_PROTOCOL)


def looks_like_pdtensor(buffer: Any) -> bool:
    """True when ``buffer`` starts like a protocol-4 pickle (cheap sniffing, no validation)."""
    return bytes(memoryview(buffer)[:2]) == _PROTO_PREFIX


@dataclass(frozen=True)
class PdTensor:
    """A parsed ``.pdtensor``: the array (read-only view) and where its data lies."""

    array: np.ndarray
    data_offset: int
    total_bytes: int

    @property
    def header(self) -> dict[str, Any]:
        """What ``fd-rr show`` prints about the file."""
        return {
            "format": RecordFormat.FASTDEPLOY_RAW.value,
            "container": f"paddle.save pickle (protocol {PICKLE_PROTOCOL}) of a numpy array",
            "dtype": str(self.array.dtype),
            "stored_shape": list(self.array.shape),
            "fill_value": fastdeploy_fill(self.array.dtype),
            "data_offset": self.data_offset,
        }


class _Tokens:
    """Cursor over the opcodes of a stream; FRAME opcodes are skipped, errors name the source."""

    def __init__(self, stream: Any, source: str) -> None:
        self._ops: Iterator[tuple[Any, Any, int | None]] = pickletools.genops(stream)
        self.source = source
        self.count = 0
        self.last_pos = 0

    def fail(self, problem: str) -> RecordError:
        return RecordError(f"{self.source}: not a FastDeploy routing .pdtensor: {problem}")

    def next(self) -> tuple[str, Any, int]:
        while True:
            self.count += 1
            if self.count > _MAX_OPCODES:
                raise self.fail(f"more than {_MAX_OPCODES} opcodes")
            try:
                opcode, arg, pos = next(self._ops)
            except StopIteration:
                raise self.fail(f"stream ends after byte {self.last_pos}") from None
            except ValueError as exc:  # truncated argument, unknown opcode byte, ...
                raise self.fail(f"malformed pickle after byte {self.last_pos}: {exc}") from exc
            self.last_pos = int(pos or 0)
            if opcode.name != "FRAME":
                return opcode.name, arg, self.last_pos

    def expect(self, name: str, check: Callable[[Any], bool] | None = None,
               what: str = "") -> Any:
        found, arg, pos = self.next()
        if found != name or (check is not None and not check(arg)):
            shown = arg if not isinstance(arg, bytes | bytearray) or len(arg) <= 16 else (
                f"<{len(arg)} bytes>")
            wanted = f"{name}{' ' + what if what else ''}"
            suffix = "" if arg is None else f" {shown!r}"
            raise self.fail(f"at byte {pos}: expected {wanted}, found {found}{suffix}")
        return arg

    def expect_arg(self, name: str, value: Any) -> None:
        self.expect(name, lambda arg: arg == value and type(arg) is type(value), repr(value))

    def expect_memoized(self, name: str, value: Any) -> None:
        self.expect_arg(name, value)
        self.expect("MEMOIZE")

    def expect_global(self, module: str | tuple[str, ...], name: str) -> str:
        """A STACK_GLOBAL of ``module.name`` (two memoized strings); any other is refused."""
        modules = (module,) if isinstance(module, str) else module
        found_module = self.expect("SHORT_BINUNICODE", what="(a module name)")
        self.expect("MEMOIZE")
        found_name = self.expect("SHORT_BINUNICODE", what="(a global's name)")
        if found_module not in modules or found_name != name:
            allowed = " or ".join(f"{m}.{name}" for m in modules)
            raise self.fail(f"global {found_module}.{found_name} is not allowed here "
                            f"(only {allowed})")
        self.expect("MEMOIZE")
        self.expect("STACK_GLOBAL")
        self.expect("MEMOIZE")
        return found_module


def decode_pdtensor(buffer: bytes | bytearray | memoryview, *, source: str = ".pdtensor",
                    ndim: tuple[int, ...] = (2, 3)) -> PdTensor:
    """Parse what ``paddle.save(numpy_array)`` wrote, without unpickling (module docstring).

    ``source`` (a path or key) prefixes every error; ``ndim`` lists the dimensionalities
    accepted.  The array is a read-only view on ``buffer``: keep it alive and unchanged.
    """
    view = byte_view(buffer, source)
    if not looks_like_pdtensor(view):
        raise RecordError(f"{source}: not a FastDeploy routing .pdtensor: it does not start "
                          f"with a protocol-{PICKLE_PROTOCOL} pickle header (first bytes "
                          f"{bytes(view[:8])!r})")
    stream = buffer if isinstance(buffer, bytes) else io.BytesIO(view)
    tokens = _Tokens(stream, source)
    tokens.expect_arg("PROTO", PICKLE_PROTOCOL)
    # _reconstruct(ndarray, (0,), b"b"), then BUILD with the array's state.
    tokens.expect_global(_RECONSTRUCT_MODULES, "_reconstruct")
    tokens.expect_global("numpy", "ndarray")
    tokens.expect_arg("BININT1", 0)
    tokens.expect("TUPLE1")
    tokens.expect("MEMOIZE")
    tokens.expect_memoized("SHORT_BINBYTES", b"b")
    for name in ("TUPLE3", "MEMOIZE", "REDUCE", "MEMOIZE", "MARK"):
        tokens.expect(name)
    tokens.expect_arg("BININT1", 1)  # ndarray state version
    shape = _read_shape(tokens, ndim)
    dtype = _read_dtype(tokens)
    tokens.expect("NEWFALSE", what="(C order; Fortran order is not what FastDeploy writes)")
    name, data, pos = tokens.next()
    if name not in _BYTES_HEADER:
        raise tokens.fail(f"at byte {pos}: expected the array's data bytes, found {name}")
    expected = math.prod(shape) * dtype.itemsize
    if len(data) != expected:
        raise tokens.fail(f"data holds {len(data)} bytes, but shape {list(shape)} of "
                          f"{dtype} needs {expected}")
    data_offset = pos + 1 + _BYTES_HEADER[name]
    for name in ("MEMOIZE", "TUPLE", "MEMOIZE", "BUILD"):
        tokens.expect(name)
    return _finish(view, tokens, shape, dtype, data_offset)


def _finish(view: memoryview, tokens: _Tokens, shape: tuple[int, ...], dtype: np.dtype,
            data_offset: int) -> PdTensor:
    name, _, pos = tokens.next()
    if name != "STOP":
        raise tokens.fail(f"at byte {pos}: expected STOP, found {name}")
    if pos + 1 != view.nbytes:
        raise tokens.fail(f"{view.nbytes - pos - 1} unexpected bytes after the pickle's STOP "
                          f"at byte {pos}")
    array = np.frombuffer(view, dtype=dtype, count=math.prod(shape), offset=data_offset)
    array = array.reshape(shape)
    array.flags.writeable = False
    return PdTensor(array, data_offset, view.nbytes)


def _read_shape(tokens: _Tokens, ndim: tuple[int, ...]) -> tuple[int, ...]:
    shape: list[int] = []
    while True:
        name, arg, pos = tokens.next()
        if name in _INT_OPCODES:
            if not isinstance(arg, int) or arg < 0:
                raise tokens.fail(f"at byte {pos}: shape dimension {arg!r} is negative")
            shape.append(arg)
            continue
        tuple_of = {"TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3}.get(name)
        if tuple_of is None or tuple_of != len(shape):
            raise tokens.fail(f"at byte {pos}: expected the array's shape, found {name}")
        break
    if len(shape) not in ndim:
        raise tokens.fail(f"shape {shape} has {len(shape)} dimensions; expected "
                          f"{' or '.join(map(str, ndim))} ([tokens, top_k] per layer, "
                          "[layers, tokens, top_k] fused)")
    tokens.expect("MEMOIZE")
    return tuple(shape)


def _read_dtype(tokens: _Tokens) -> np.dtype:
    # numpy.dtype(code, False, True), then BUILD (3, byteorder, None, None, None, -1, -1, 0).
    name, arg, pos = tokens.next()
    if name == "SHORT_BINUNICODE":  # "numpy" spelled out instead of fetched from the memo
        if arg != "numpy":
            raise tokens.fail(f"global {arg}.dtype is not allowed (only numpy.dtype)")
        tokens.expect("MEMOIZE")
    elif name != "BINGET" or arg != 3:
        raise tokens.fail(f"at byte {pos}: expected the global numpy.dtype, found {name} {arg!r}")
    attribute = tokens.expect("SHORT_BINUNICODE")
    if attribute != "dtype":
        raise tokens.fail(f"global numpy.{attribute} is not allowed (only numpy.dtype)")
    for step in ("MEMOIZE", "STACK_GLOBAL", "MEMOIZE"):
        tokens.expect(step)
    code = tokens.expect("SHORT_BINUNICODE")
    if code not in _BY_CODE:
        raise tokens.fail(f"dtype {code!r} is not one FastDeploy writes (expected "
                          f"{', '.join(sorted(_BY_CODE))}: {', '.join(FASTDEPLOY_DTYPES)})")
    dtype = _BY_CODE[code]
    for step in ("MEMOIZE", "NEWFALSE", "NEWTRUE", "TUPLE3", "MEMOIZE", "REDUCE", "MEMOIZE",
                 "MARK"):
        tokens.expect(step)
    tokens.expect_arg("BININT1", 3)
    order = "|" if dtype.itemsize == 1 else "<"
    found = tokens.expect("SHORT_BINUNICODE")
    if found != order:
        raise tokens.fail(f"dtype {code} has byte order {found!r}; expected {order!r} "
                          "(FastDeploy writes little-endian)")
    tokens.expect("MEMOIZE")
    for step in ("NONE", "NONE", "NONE"):
        tokens.expect(step)
    tokens.expect_arg("BININT", -1)
    tokens.expect_arg("BININT", -1)
    tokens.expect_arg("BININT1", 0)
    for step in ("TUPLE", "MEMOIZE", "BUILD"):
        tokens.expect(step)
    return dtype


def pad_tokens(ids: np.ndarray, max_model_len: int, fill_value: int | None = None) -> np.ndarray:
    """FastDeploy's ``pad_routing_indices``: pad the token axis (-2) to ``max_model_len``.

    Cells equal to ``fill_value`` (default: FastDeploy's fill) become FastDeploy's fill, so
    the result is exactly what FastDeploy would have saved.
    """
    dtype = _check_dtype(ids.dtype, "fastdeploy layout")
    fill = fastdeploy_fill(dtype)
    tokens = ids.shape[-2]
    if tokens > max_model_len:
        raise RecordError(f"fastdeploy layout: {tokens} tokens do not fit max_model_len "
                          f"{max_model_len}")
    out = np.full((*ids.shape[:-2], max_model_len, ids.shape[-1]), fill, dtype=dtype)
    out[..., :tokens, :] = ids
    if fill_value is not None and fill_value != fill:
        rows = out[..., :tokens, :]
        rows[ids == fill_value] = fill
    return out


def trim_padding(ids: np.ndarray) -> np.ndarray:
    """Drop trailing tokens whose every slot, in every layer, is the fill (``[L, T, K]``)."""
    if ids.size == 0:
        return ids[..., :0, :]
    used = (ids != fastdeploy_fill(ids.dtype)).any(axis=-1)  # [L, T]
    used = used.any(axis=0) if ids.ndim == 3 else used
    nonzero = np.flatnonzero(used)
    tokens = int(nonzero[-1]) + 1 if nonzero.size else 0
    return ids[..., :tokens, :]


def record_from_pdtensor(buffer: bytes | bytearray | memoryview, rollout_id: str, *,
                         layer: int | None = None, trim: bool = True,
                         source: str = ".pdtensor") -> tuple[RoutingRecord, dict[str, Any]]:
    """A ``.pdtensor`` as a ``[layers, tokens, top_k]`` record, and a header describing it.

    A per-layer file (``layer`` given) must be 2-D and becomes one layer; a fused file
    must be 3-D.  With ``trim`` the padding (trailing tokens whose every slot is the fill)
    is dropped.  The file does not say how many experts the model has, so the record's
    ``num_experts`` is the fill value itself (every id below the fill is accepted; int64:
    the dtype's max) and ``metadata["format"]`` is ``"fastdeploy-raw"``.
    """
    parsed = decode_pdtensor(buffer, source=source, ndim=(3,) if layer is None else (2,))
    ids = parsed.array if layer is None else parsed.array[np.newaxis]
    fill = fastdeploy_fill(ids.dtype)
    if ids.dtype.kind == "i" and ids.size and int(ids.min()) < fill:
        raise RecordError(f"{source}: int64 routing holds {int(ids.min())}; FastDeploy writes "
                          "ids ≥ 0 and -1 for no routing")
    max_model_len = int(ids.shape[1])
    if trim:
        ids = np.ascontiguousarray(trim_padding(ids))
        ids.flags.writeable = False
    num_experts = fill if fill > 0 else int(np.iinfo(ids.dtype).max)
    metadata: dict[str, Any] = {"format": RecordFormat.FASTDEPLOY_RAW.value, "num_tokens": int(ids.shape[1]),
                                "max_model_len": max_model_len}
    if layer is not None:
        metadata["layer"] = layer
    header = {"rollout_id": rollout_id, **parsed.header,
              "layout": "fused" if layer is None else "per-layer",
              "shape": list(ids.shape), "num_tokens": int(ids.shape[1]),
              "max_model_len": max_model_len}
    if layer is not None:
        header["layer"] = layer
    return RoutingRecord(rollout_id, ids, num_experts, fill, metadata), header
