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

Two implementations, bit for bit the same: the compiled codec (custom_ops/set_codec.cc in
the C library of :mod:`fd_routing_replay.core.native`, no Paddle; its entry points are
declared here, calls release the GIL, the per-(E, k) tables are built once and shared by
threads) and the NumPy reference (:mod:`fd_routing_replay.codec.set_numpy`), used when the
compiled one cannot load (with a warning) or with ``FD_RR_OPS=reference``.  This module
checks the arguments and the payload's framing and dispatches; :func:`set_codec_backend`
says which.
"""

from __future__ import annotations

import ctypes
import weakref
from functools import lru_cache
from pathlib import Path

import numpy as np

from fd_routing_replay.codec.set_format import (
    MAX_RANK_BITS,
    MAX_SET_EXPERTS,
    SetEncodingError,
    check_trailing_bits,
    not_a_set,
    payload_nbytes,
    rank_bits,
    rank_too_large,
)
from fd_routing_replay.codec.set_numpy import decode_sets_numpy, encode_sets_numpy
from fd_routing_replay.core.native import CLibrary, c_library
from fd_routing_replay.errors import OpsError, RecordError

__all__ = ["MAX_RANK_BITS", "MAX_SET_EXPERTS", "NativeCodec", "SetEncodingError", "decode_sets",
           "encode_sets", "native_codec", "payload_nbytes", "rank_bits", "set_codec_backend",
           "set_codec_reason"]

_NATIVE_DTYPES = ("|u1", "<u2", "<u4")


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

    def encode(self, ids: np.ndarray, num_experts: int, fill_value: int, out: np.ndarray) -> int:
        """Encode ``ids`` ([L, T, K], C-contiguous uint8/16/32) into ``out`` (uint8 of the
        payload's size): -1, or the first row that is neither a set nor padding."""
        tables = self.tables(num_experts, int(ids.shape[2]))
        rows = int(ids.shape[0]) * int(ids.shape[1])
        result = self.lib.fdrr_set_encode(tables.handle, ids.ctypes.data, ids.itemsize, rows,
                                          fill_value, out.ctypes.data, out.size)
        return self._checked(result, "encode")

    def decode(self, stream: np.ndarray, num_experts: int, fill_value: int,
               out: np.ndarray) -> int:
        """Decode ``stream`` (uint8 of the payload's size) into ``out`` ([rows, K],
        C-contiguous): -1, or the first row whose rank is above C(E, K)."""
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
    """The compiled codec, or None when this process uses the NumPy reference (OpsError
    under ``FD_RR_OPS=compiled`` when the library cannot load)."""
    loaded = c_library()
    return None if loaded.handle is None else _declared(loaded)


def set_codec_backend() -> str:
    """``"native"`` (the compiled codec) or ``"numpy"`` (the reference) in this process.

    OpsError under ``FD_RR_OPS=compiled`` when the compiled codec cannot load."""
    return "numpy" if c_library().handle is None else "native"


def set_codec_reason() -> str:
    """Why :func:`set_codec_backend` is what it is (which library, or what failed)."""
    return c_library().reason


def encode_sets(ids: np.ndarray, num_experts: int, fill_value: int) -> np.ndarray:
    """The set payload of ``ids`` (``[L, T, K]`` unsigned ints) as a uint8 array.

    Every row must be ``K`` distinct ids below ``num_experts`` or ``K`` times
    ``fill_value``; anything else (duplicates, a partly filled row, an id out of range)
    raises SetEncodingError naming the first such row.  Order inside a row is not kept.
    """
    if ids.ndim != 3:
        raise SetEncodingError(f"set encoding: ids must be [layers, tokens, top_k], got shape "
                               f"{ids.shape}")
    top_k = int(ids.shape[2])
    total = payload_nbytes(int(ids.shape[0]) * int(ids.shape[1]), num_experts, top_k)
    if total == 0:
        return np.zeros(0, dtype=np.uint8)
    native = native_codec()
    if native is None or ids.dtype.str not in _NATIVE_DTYPES or not 0 <= fill_value < 2**32:
        return encode_sets_numpy(ids, num_experts, fill_value)
    out = np.empty(total, dtype=np.uint8)
    bad = native.encode(np.ascontiguousarray(ids), num_experts, fill_value, out)
    if bad >= 0:
        raise not_a_set(ids, bad, num_experts, fill_value)
    return out


def decode_sets(payload: memoryview | bytes | np.ndarray, shape: tuple[int, int, int],
                num_experts: int, fill_value: int, dtype: np.dtype) -> np.ndarray:
    """The ``[L, T, K]`` ids a set payload holds, each row ascending (padding rows all
    ``fill_value``).  RecordError on a payload of the wrong size, a rank out of range or
    non-zero trailing bits (a corrupt payload)."""
    layers, tokens, top_k = shape
    count = layers * tokens
    stream = np.frombuffer(payload, dtype=np.uint8)
    expected = payload_nbytes(count, num_experts, top_k)
    if stream.size != expected:
        raise RecordError(f"set payload has {stream.size} bytes, but {count} rows of "
                          f"C({num_experts}, {top_k}) ranks need {expected}")
    dtype = np.dtype(dtype)
    if count * top_k == 0:
        return np.empty(shape, dtype=dtype)
    check_trailing_bits(stream, count, rank_bits(num_experts, top_k))
    native = native_codec()
    if native is None or dtype.str not in _NATIVE_DTYPES or not 0 <= fill_value < 2**32:
        return decode_sets_numpy(stream, shape, num_experts, fill_value, dtype)
    ids = np.empty((count, top_k), dtype=dtype)
    bad = native.decode(stream, num_experts, fill_value, ids)
    if bad >= 0:
        raise rank_too_large(stream, bad, num_experts, top_k)
    return ids.reshape(shape)
