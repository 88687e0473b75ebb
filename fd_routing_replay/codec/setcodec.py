"""The ``set`` payload encoding of rr-v1: each token-layer's top-k as a set, bit-packed.

Routing replay needs *which* experts a token went to in a layer, not in which order the
router ranked them (the trainer recomputes the weights from its own router scores).  A
set of ``k`` distinct ids out of ``E`` carries log2 C(E, k) bits; the ``plain`` encoding
spends ``k`` whole bytes (or more) on it.  This module stores each row — one token in one
layer, ``k`` ids — as one integer, the row's rank in the combinatorial number system,
in a fixed width of ``b = C(E, k).bit_length()`` bits (up to 128), and packs those
integers back to back into a little-endian bit stream.  The spare value ``C(E, k)`` (one
past the largest rank) marks a *padding row*: a row whose ``k`` slots all hold the
record's fill value.

Rank of the sorted set ``c_0 < c_1 < ... < c_{k-1}`` (each in ``[0, E)``)::

    rank = C(c_0, 1) + C(c_1, 2) + ... + C(c_{k-1}, k)          (C(n, j) = 0 when n < j)

which enumerates the C(E, k) sets as 0 .. C(E, k) - 1.  Decoding picks, for j = k .. 1,
the largest ``c`` with ``C(c, j) <= rest`` and subtracts it (greedy), giving the ids in
ascending order.  Row ``n`` (C order over ``[L, T]``) occupies stream bits
``[n*b, (n+1)*b)``; stream bit ``i`` is bit ``i % 8`` of payload byte ``i // 8``; the
payload is ``ceil(L*T*b / 8)`` bytes and the unused high bits of its last byte are zero.
docs/record-format.md is the normative description.

One implementation runs: the compiled codec (custom_ops/set_codec.cc in the Paddle-free C
library of :mod:`fd_routing_replay.core.native`; calls release the GIL, the per-(E, k)
tables are built once and shared by threads).  This module holds what a set payload is
(its width, size and errors), checks the arguments and the payload's framing, and calls
the library.  Where the library did not load, encoding raises :class:`SetEncodingError`
(the record can still be written plain) and decoding raises ``OpsError``, each saying why
it did not load.  The tests check the library against an independent NumPy oracle
(tests/set_oracle.py) and a pure-Python encoder of the format.
"""

from __future__ import annotations

import ctypes
import math
import weakref
from functools import lru_cache
from pathlib import Path

import numpy as np

from fd_routing_replay.core.native import C_LIBRARY, CLibrary, c_library
from fd_routing_replay.errors import OpsError, RecordError

__all__ = ["MAX_RANK_BITS", "MAX_SET_EXPERTS", "MAX_SET_TABLE", "NativeCodec", "SetEncodingError",
           "check_trailing_bits", "decode_sets", "describe_row", "encode_sets", "native_codec",
           "not_a_set", "payload_nbytes", "rank_bits", "rank_too_large", "row_value",
           "set_codec_backend", "set_codec_reason"]

MAX_RANK_BITS = 128
"""Widest rank supported: two 64-bit words per row (``C(E, k) < 2**128``).  Ranks up to
64 bits keep the layout they always had (the format does not depend on the width)."""
MAX_SET_EXPERTS = 1 << 16
"""Most experts a set record may have (bounds the lookup tables a corrupt header can ask for)."""
MAX_SET_TABLE = 1 << 22
"""Most binomials ``(top_k + 1) * num_experts`` the tables may hold (64 MiB at 128 bits),
so a header cannot ask for gigabytes; only ``top_k`` close to a huge ``num_experts``
(e.g. E = 65,536, k > 63, whose ranks are far wider than 128 bits anyway) is refused."""
_LIBRARY_DTYPES = (np.dtype("u1"), np.dtype("<u2"), np.dtype("<u4"))
"""The id dtypes the library reads and writes (1, 2 or 4 bytes, little-endian)."""


class SetEncodingError(RecordError):
    """The ids cannot be stored as sets (a row that is neither k distinct expert ids nor
    all fill, C(E, k) too large, or no compiled codec here): the record can still be
    written ``plain``."""


# ------------------------------------------------------------------ what a set payload is


def rank_bits(num_experts: int, top_k: int) -> int:
    """Bits per row: ``C(num_experts, top_k).bit_length()`` (ranks plus the padding value).

    SetEncodingError when ``top_k`` exceeds ``num_experts``, the experts or tables exceed
    their bounds, or the width exceeds :data:`MAX_RANK_BITS`.
    """
    if not 0 <= top_k <= num_experts:
        raise SetEncodingError(f"set encoding: top_k {top_k} must be in [0, num_experts="
                               f"{num_experts}] (a row holds {top_k} distinct expert ids)")
    if num_experts > MAX_SET_EXPERTS:
        raise SetEncodingError(f"set encoding: num_experts {num_experts} is above the "
                               f"{MAX_SET_EXPERTS} it supports; use capture.encoding: plain")
    if (top_k + 1) * num_experts > MAX_SET_TABLE:
        raise SetEncodingError(f"set encoding: top_k {top_k} with num_experts {num_experts} needs "
                               f"more than {MAX_SET_TABLE} table entries; use capture.encoding: plain")
    bits = math.comb(num_experts, top_k).bit_length()
    if bits > MAX_RANK_BITS:
        raise SetEncodingError(
            f"set encoding: C({num_experts}, {top_k}) needs {bits} bits per row, more than "
            f"the {MAX_RANK_BITS} this implementation supports; use capture.encoding: plain")
    return bits


def payload_nbytes(num_rows: int, num_experts: int, top_k: int) -> int:
    """Bytes of a set payload of ``num_rows`` rows (``L * T``); 0 when there is nothing
    to store (no rows, or ``top_k == 0``)."""
    if num_rows == 0 or top_k == 0:
        return 0
    return -(-num_rows * rank_bits(num_experts, top_k) // 8)


def describe_row(ids: np.ndarray, row: int) -> str:
    """``[layer l, token t] = [...]``: row ``row`` (C order over ``[L, T]``) of ``ids``."""
    layer, token = divmod(row, ids.shape[1]) if ids.shape[1] else (row, 0)
    return f"[layer {layer}, token {token}] = {ids.reshape(-1, ids.shape[2])[row].tolist()}"


def not_a_set(ids: np.ndarray, row: int, num_experts: int, fill_value: int) -> SetEncodingError:
    """The error for row ``row`` of ``ids``, which is neither a set nor padding."""
    top_k = ids.shape[2]
    return SetEncodingError(
        f"set encoding: row {describe_row(ids, row)} is neither {top_k} distinct expert "
        f"ids below num_experts {num_experts} nor a padding row (all fill value "
        f"{fill_value}); such a record can only be written plain")


def row_value(stream: np.ndarray, row: int, bits: int) -> int:
    """The ``bits``-bit value of row ``row`` in the payload ``stream`` (uint8), exactly."""
    first, last = row * bits // 8, -(-(row + 1) * bits // 8)
    window = int.from_bytes(stream[first:last].tobytes(), "little")
    return (window >> (row * bits - 8 * first)) & ((1 << bits) - 1)


def rank_too_large(stream: np.ndarray, row: int, num_experts: int, top_k: int) -> RecordError:
    """The error for row ``row`` of a payload, whose value is above ``C(E, k)``."""
    padding = math.comb(num_experts, top_k)
    value = row_value(stream, row, padding.bit_length())
    return RecordError(f"set payload: row {row} holds rank {value}, above the largest "
                       f"C({num_experts}, {top_k}) = {padding} (corrupt payload)")


def check_trailing_bits(stream: np.ndarray, count: int, bits: int) -> None:
    """RecordError when the unused high bits of the payload's last byte are not zero."""
    used = count * bits
    if used % 8 and int(stream[-1]) >> (used % 8):
        raise RecordError(f"set payload: non-zero bits after the last of {count} rows "
                          "(corrupt or truncated payload)")


# ------------------------------------------------------------------ the compiled codec


class _Tables:
    """The library's tables for one (E, k), freed with this object."""

    def __init__(self, lib: ctypes.CDLL, num_experts: int, top_k: int) -> None:
        self.handle = lib.fdrr_set_context_new(num_experts, top_k)
        if not self.handle:
            raise OpsError(f"the compiled set codec refuses C({num_experts}, {top_k})")
        self.bits = int(lib.fdrr_set_context_bits(self.handle))
        weakref.finalize(self, lib.fdrr_set_context_free, self.handle)


class NativeCodec:
    """The loaded library: encode and decode rows, each returning the first bad row or -1."""

    def __init__(self, lib: ctypes.CDLL, library: Path) -> None:
        self.lib = lib
        self.library = library
        self._tables = lru_cache(maxsize=16)(lambda e, k: _Tables(lib, e, k))

    def tables(self, num_experts: int, top_k: int) -> _Tables:
        """The (cached) tables for C(num_experts, top_k)."""
        return self._tables(num_experts, top_k)

    def encode(self, rows: np.ndarray, num_experts: int, fill_value: int, out: np.ndarray) -> int:
        """Encode ``rows`` ([n, K], C-contiguous, a dtype of :data:`_LIBRARY_DTYPES` that
        holds ``num_experts - 1`` and ``fill_value``) into ``out`` (uint8 of the payload's
        size): -1, or the first row that is neither a set nor padding."""
        tables = self.tables(num_experts, int(rows.shape[1]))
        result = self.lib.fdrr_set_encode(tables.handle, rows.ctypes.data, rows.itemsize,
                                          int(rows.shape[0]), fill_value, out.ctypes.data, out.size)
        return self._checked(result, "encode")

    def decode(self, stream: np.ndarray, num_experts: int, fill_value: int,
               out: np.ndarray) -> int:
        """Decode ``stream`` (uint8 of the payload's size) into ``out`` ([n, K],
        C-contiguous, as in :meth:`encode`): -1, or the first row whose rank is above C(E, K)."""
        tables = self.tables(num_experts, int(out.shape[1]))
        result = self.lib.fdrr_set_decode(tables.handle, stream.ctypes.data, stream.size,
                                          int(out.shape[0]), out.ctypes.data, out.itemsize,
                                          fill_value)
        return self._checked(result, "decode")

    @staticmethod
    def _checked(result: int, what: str) -> int:
        if result < -1:
            raise OpsError(f"the compiled set codec refused the arguments of {what} ({result})")
        return result


@lru_cache(maxsize=1)
def _declared(loaded: CLibrary) -> NativeCodec:
    """The set codec's entry points of the loaded library, declared once."""
    lib = loaded.handle
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.fdrr_set_context_new.restype = ptr
    lib.fdrr_set_context_new.argtypes = [i64, i64]
    lib.fdrr_set_context_free.restype = None
    lib.fdrr_set_context_free.argtypes = [ptr]
    lib.fdrr_set_context_bits.restype = i64
    lib.fdrr_set_context_bits.argtypes = [ptr]
    lib.fdrr_set_encode.restype = i64
    lib.fdrr_set_encode.argtypes = [ptr, ptr, i64, i64, ctypes.c_uint64, ptr, i64]
    lib.fdrr_set_decode.restype = i64
    lib.fdrr_set_decode.argtypes = [ptr, ptr, i64, i64, ptr, i64, ctypes.c_uint64]
    return NativeCodec(lib, loaded.path)


def native_codec() -> NativeCodec | None:
    """The compiled codec, or None when the C library did not load (:func:`set_codec_reason`
    says why; OpsError instead under ``FD_RR_OPS=compiled``)."""
    loaded = c_library()
    return None if loaded.handle is None else _declared(loaded)


def set_codec_backend() -> str:
    """``"native"`` (the compiled codec) or ``"unavailable"`` (the C library did not load:
    set payloads can be neither encoded nor decoded in this process).

    OpsError under ``FD_RR_OPS=compiled`` when the C library cannot load."""
    return "unavailable" if c_library().handle is None else "native"


def set_codec_reason() -> str:
    """Why :func:`set_codec_backend` is what it is (which library, or what failed)."""
    return c_library().reason


def _unavailable(what: str) -> str:
    return (f"{what} needs the compiled C library {C_LIBRARY.file_name}, which did not load: "
            f"{set_codec_reason()}")


# ------------------------------------------------------------------ arguments


def _fill(fill_value: object) -> int:
    """``fill_value`` as an int the library takes (< 2**32), else SetEncodingError naming it."""
    if isinstance(fill_value, (bool, np.bool_)) or not isinstance(fill_value, (int, np.integer)) \
            or not 0 <= int(fill_value) < 2**32:
        raise SetEncodingError(f"set encoding: fill_value {fill_value!r} must be an int in "
                               f"[0, 2**32 - 1] (ids of at most 32 bits)")
    return int(fill_value)


def _library_dtype(dtype: np.dtype, num_experts: int, fill_value: int) -> np.dtype:
    """The dtype the library works in for ids of ``dtype``: ``dtype`` itself when the library
    takes it and it holds every expert id and the fill value, else the smallest that does."""
    largest = max(num_experts - 1, fill_value)
    if dtype in _LIBRARY_DTYPES and largest <= np.iinfo(dtype).max:
        return np.dtype(dtype)
    return next(dt for dt in _LIBRARY_DTYPES if largest <= np.iinfo(dt).max)


def _integer_dtype(dtype: np.dtype, what: str) -> np.dtype:
    if dtype.kind not in "ui":
        raise SetEncodingError(f"set encoding: {what} dtype {dtype} is not an integer dtype")
    return dtype


# ------------------------------------------------------------------ encode, decode


def encode_sets(ids: np.ndarray, num_experts: int, fill_value: int) -> np.ndarray:
    """The set payload of ``ids`` (``[L, T, K]`` integers) as a uint8 array.

    Every row must be ``K`` distinct ids below ``num_experts`` or ``K`` times
    ``fill_value``; anything else (duplicates, a partly filled row, an id out of range)
    raises SetEncodingError naming the first such row.  Order inside a row is not kept.
    Ids of a dtype the library does not take (uint64, signed, big-endian, ...) are
    converted; a ``fill_value`` outside ``[0, 2**32)`` is refused by name.
    """
    if ids.ndim != 3:
        raise SetEncodingError(f"set encoding: ids must be [layers, tokens, top_k], got shape "
                               f"{ids.shape}")
    dtype = _integer_dtype(ids.dtype, "ids")
    fill = _fill(fill_value)
    count, top_k = int(ids.shape[0]) * int(ids.shape[1]), int(ids.shape[2])
    total = payload_nbytes(count, num_experts, top_k)
    if total == 0:
        return np.zeros(0, dtype=np.uint8)
    native = native_codec()
    if native is None:
        raise SetEncodingError(_unavailable("set encoding") + "; the record can be written plain")
    rows = ids.reshape(count, top_k)
    target = _library_dtype(dtype, num_experts, fill)
    limit = count
    if target != dtype:  # a value the target cannot hold makes its row neither a set nor padding
        outside = ((rows < 0) | (rows > np.iinfo(target).max)).any(axis=1)
        limit = int(np.argmax(outside)) if outside.any() else count
    rows = np.ascontiguousarray(rows[:limit], dtype=target)
    out = np.empty(payload_nbytes(limit, num_experts, top_k), dtype=np.uint8)
    bad = native.encode(rows, num_experts, fill, out) if limit else -1
    if bad >= 0 or limit < count:
        raise not_a_set(ids, bad if bad >= 0 else limit, num_experts, fill)
    return out


def decode_sets(payload: memoryview | bytes | np.ndarray, shape: tuple[int, int, int],
                num_experts: int, fill_value: int, dtype: np.dtype) -> np.ndarray:
    """The ``[L, T, K]`` ids (of integer ``dtype``) a set payload holds, each row ascending
    (padding rows all ``fill_value``).  RecordError on a payload of the wrong size, a rank
    out of range or non-zero trailing bits (a corrupt payload); OpsError when the compiled
    codec did not load."""
    layers, tokens, top_k = shape
    count = layers * tokens
    stream = np.frombuffer(payload, dtype=np.uint8)
    expected = payload_nbytes(count, num_experts, top_k)
    if stream.size != expected:
        raise RecordError(f"set payload has {stream.size} bytes, but {count} rows of "
                          f"C({num_experts}, {top_k}) ranks need {expected}")
    dtype = _integer_dtype(np.dtype(dtype), "ids")
    fill = _fill(fill_value)
    largest = max(num_experts - 1, fill)
    if largest > np.iinfo(dtype).max:
        raise SetEncodingError(f"set decoding: dtype {dtype} cannot hold fill_value {fill} "
                               f"and expert ids below num_experts {num_experts}")
    if count * top_k == 0:
        return np.empty(shape, dtype=dtype)
    check_trailing_bits(stream, count, rank_bits(num_experts, top_k))
    native = native_codec()
    if native is None:
        raise OpsError(_unavailable("decoding a set payload") + " (build it with `make ops`)")
    ids = np.empty((count, top_k), dtype=_library_dtype(dtype, num_experts, fill))
    bad = native.decode(stream, num_experts, fill, ids)
    if bad >= 0:
        raise rank_too_large(stream, bad, num_experts, top_k)
    return ids.astype(dtype, copy=False).reshape(shape)
