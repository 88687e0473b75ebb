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

Two implementations, bit for bit the same: the compiled codec
(:mod:`fd_routing_replay.codec.set_native`, custom_ops/set_codec.cc, no Paddle) and the
NumPy reference (:mod:`fd_routing_replay.codec.set_numpy`), used when the compiled one
cannot load (with a warning) or with ``FD_RR_OPS=reference``.  This module checks the
arguments and the payload's framing and dispatches; :func:`set_codec_backend` says which.
"""

from __future__ import annotations

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
from fd_routing_replay.codec.set_native import native_codec, set_codec_choice
from fd_routing_replay.codec.set_numpy import decode_sets_numpy, encode_sets_numpy
from fd_routing_replay.errors import RecordError

__all__ = ["MAX_RANK_BITS", "MAX_SET_EXPERTS", "SetEncodingError", "decode_sets", "encode_sets",
           "payload_nbytes", "rank_bits", "set_codec_backend", "set_codec_reason"]

_NATIVE_DTYPES = ("|u1", "<u2", "<u4")


def set_codec_backend() -> str:
    """``"native"`` (the compiled codec) or ``"numpy"`` (the reference) in this process.

    OpsError under ``FD_RR_OPS=compiled`` when the compiled codec cannot load."""
    return set_codec_choice().name


def set_codec_reason() -> str:
    """Why :func:`set_codec_backend` is what it is (which library, or what failed)."""
    return set_codec_choice().reason


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
