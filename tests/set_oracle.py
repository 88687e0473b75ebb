"""The ``set`` payload encoding in vectorised NumPy: the tests' independent oracle.

The package runs one implementation, the compiled codec
(:mod:`fd_routing_replay.codec.setcodec`, custom_ops/set_codec.cc); this one, written
apart from it, is what the tests compare it with, byte for byte, on fresh random inputs.

Each row (k expert ids) becomes its colex rank ``C(c_0, 1) + ... + C(c_{k-1}, k)`` over
the sorted ids (a sorting network of element-wise min/max).  Decoding picks, for
j = k .. 2, the largest ``c`` with ``C(c, j) <= rest`` — a float-bits table guess plus a
fixed number of exact steps while the rest fits 64 bits, a vectorised binary search over
128-bit binomials (two uint64 limbs) above that — and subtracts it.  Ranks up to 64 bits
are one uint64 per row; wider ones (up to 128 bits) are a (low, high) pair of uint64 arrays.

The bit stream: row ``n``'s value occupies stream bits ``[n*b, (n+1)*b)``; stream bit
``i`` is bit ``i % 8`` of byte ``i // 8``.  A value is given as 64-bit *limbs*, least
significant first: one limb when ``b <= 64``, two (the low 64 bits, then the high
``b - 64``) up to ``b = 128``; each limb is a field of at most 64 bits at a known offset,
so packing is shifts and ORs over uint64 columns.  64 rows of ``b`` bits fill exactly
``b`` words, so rows are handled in groups of 64.

:func:`encode_sets` and :func:`decode_sets` take what the package's functions of the
same names take (ids of any integer dtype, any fill value they hold) and raise the same
errors for bad rows and corrupt payloads.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from fd_routing_replay.codec.setcodec import (
    check_trailing_bits,
    not_a_set,
    payload_nbytes,
    rank_bits,
    rank_too_large,
)
from fd_routing_replay.errors import RecordError

GROUP = 64
"""Rows per group: 64 rows of b bits fill exactly b uint64 words."""
_MAX_GUESS_BITS = 12
"""Mantissa bits of the unranking lookup key, at most (≤ 2 MiB per table)."""
_U64_MAX = (1 << 64) - 1
_U128_MAX = (1 << 128) - 1
_CHUNK_ROWS = 1 << 16
"""Rows encoded or decoded per pass, so temporaries stay a few MiB whatever the record."""


# ------------------------------------------------------------------ the bit stream


def limb_widths(bits: int) -> tuple[int, ...]:
    """Widths of the limbs of a ``bits``-bit value: ``(bits,)`` or ``(64, bits - 64)``."""
    return (bits,) if bits <= 64 else (64, bits - 64)


@lru_cache(maxsize=64)
def _field_plan(bits: int) -> tuple[tuple[int, int, int, int, bool], ...]:
    """(row in group, limb, first word, shift, spills into the next word) per field."""
    plan = []
    for row in range(GROUP):
        offset = row * bits
        for limb, width in enumerate(limb_widths(bits)):
            plan.append((row, limb, offset >> 6, offset & 63, (offset & 63) + width > 64))
            offset += width
    return tuple(plan)


def pack_limbs(limbs: list[np.ndarray], bits: int) -> np.ndarray:
    """The values given by ``limbs`` (uint64 arrays of one length, each limb below
    2**width) as a packed little-endian bit stream (uint8, ``ceil(count * bits / 8)``)."""
    count = limbs[0].size
    groups = -(-count // GROUP)
    columns = []
    for limb in limbs:  # [j, g] = limb of row 64 g + j
        padded = np.zeros(groups * GROUP, dtype=np.uint64)
        padded[:count] = limb
        columns.append(np.ascontiguousarray(padded.reshape(groups, GROUP).T))
    words = np.zeros((bits, groups), dtype=np.uint64)
    for row, limb, word, shift, spills in _field_plan(bits):
        column = columns[limb][row]
        words[word] |= column << np.uint64(shift)
        if spills:
            words[word + 1] |= column >> np.uint64(64 - shift)
    stream = np.ascontiguousarray(words.T).astype("<u8", copy=False).reshape(-1).view(np.uint8)
    return stream[: -(-count * bits // 8)]


def unpack_limbs(stream: np.ndarray, count: int, bits: int) -> list[np.ndarray]:
    """The ``count`` values of ``bits`` bits each in ``stream`` (uint8), as limbs."""
    groups = -(-count // GROUP)
    padded = np.zeros(groups * bits * 8, dtype=np.uint8)
    padded[: stream.size] = stream
    words = np.ascontiguousarray(padded.view("<u8").reshape(groups, bits).T)
    widths = limb_widths(bits)
    masks = [np.uint64(_U64_MAX >> (64 - width)) for width in widths]
    columns = [np.empty((GROUP, groups), dtype=np.uint64) for _ in widths]
    for row, limb, word, shift, spills in _field_plan(bits):
        column = words[word] >> np.uint64(shift)
        if spills:
            column |= words[word + 1] << np.uint64(64 - shift)
        np.bitwise_and(column, masks[limb], out=columns[limb][row])
    return [column.T.reshape(-1)[:count] for column in columns]


# ------------------------------------------------------------------ ranks

@lru_cache(maxsize=16)
def binomial_columns(num_experts: int, top_k: int) -> np.ndarray:
    """``columns[j, n] = C(n, j)`` for j in [0, k], n in [0, E), as uint64, saturated at
    2**64 - 1 (saturated entries are never reached by a valid rank; columns stay sorted)."""
    columns = np.empty((top_k + 1, num_experts), dtype=np.uint64)
    for j in range(top_k + 1):
        columns[j] = [min(math.comb(n, j), _U64_MAX) for n in range(num_experts)]
    columns.flags.writeable = False
    return columns


@lru_cache(maxsize=16)
def extended_columns(num_experts: int, top_k: int) -> np.ndarray:
    """:func:`binomial_columns` with one saturated entry appended to each column (n = E),
    so ``C(c + 1, j)`` can be looked up for every c < E."""
    extended = np.full((top_k + 1, num_experts + 1), _U64_MAX, dtype=np.uint64)
    extended[:, :num_experts] = binomial_columns(num_experts, top_k)
    extended.flags.writeable = False
    return extended


@lru_cache(maxsize=16)
def binomial_limbs(num_experts: int, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """``C(n, j)`` for j in [0, k], n in [0, E] as (low, high) uint64 limbs, saturated at
    2**128 - 1 (wide ranks; n = E included for the step comparison)."""
    values = [[min(math.comb(n, j), _U128_MAX) for n in range(num_experts + 1)]
              for j in range(top_k + 1)]
    low = np.array([[v & _U64_MAX for v in row] for row in values], dtype=np.uint64)
    high = np.array([[v >> 64 for v in row] for row in values], dtype=np.uint64)
    low.flags.writeable = high.flags.writeable = False
    return low, high


@lru_cache(maxsize=16)
def sorting_network(size: int) -> tuple[tuple[int, int], ...]:
    """Batcher's odd-even merge sort for ``size`` inputs as (low, high) comparators."""
    pairs = []
    p = 1
    while p < size:
        k = p
        while k >= 1:
            for j in range(k % p, size - k, 2 * k):
                for i in range(min(k, size - j - k)):
                    if (i + j) // (2 * p) == (i + j + k) // (2 * p):
                        pairs.append((i + j, i + j + k))
            k //= 2
        p *= 2
    return tuple(pairs)


def _sorted_columns(rows: np.ndarray) -> list[np.ndarray]:
    """The columns of ``rows`` ([n, k]) after sorting each row ascending (k contiguous
    arrays): a sorting network of elementwise min/max, far cheaper than a sort per row."""
    transposed = np.array(rows.T, order="C")  # always a copy: the caller's ids stay as they are
    columns = list(transposed)
    for low, high in sorting_network(len(columns)):
        smaller = np.minimum(columns[low], columns[high])
        np.maximum(columns[low], columns[high], out=columns[high])
        columns[low] = smaller
    return columns


def _ranks(rows: np.ndarray, num_experts: int, fill_value: int, ids: np.ndarray,
           first_row: int) -> list[np.ndarray]:
    """The rank of each row of ``rows`` ([n, k]) as limbs; the padding value for all-fill
    rows.  SetEncodingError naming the first row that is neither."""
    top_k = rows.shape[1]
    ordered = _sorted_columns(rows)
    padding = (ordered[0] == fill_value) & (ordered[-1] == fill_value)
    valid = (ordered[-1] < num_experts) & (ordered[0] >= 0)  # signed ids: -1 is no id
    for j in range(1, top_k):
        valid &= ordered[j] != ordered[j - 1]
    bad = ~(valid | padding)
    if bad.any():
        raise not_a_set(ids, first_row + int(np.argmax(bad)), num_experts, fill_value)
    has_padding = bool(padding.any())
    if has_padding:  # any in-range index will do: the rank is overwritten below
        for column in ordered:
            np.minimum(column, num_experts - 1, out=column)
    padding_rank = math.comb(num_experts, top_k)
    if padding_rank.bit_length() <= 64:
        binomials = binomial_columns(num_experts, top_k)
        ranks = binomials[1][ordered[0]]
        for j in range(1, top_k):
            ranks += binomials[j + 1][ordered[j]]
        limbs = [ranks]
    else:
        low_table, high_table = binomial_limbs(num_experts, top_k)
        low = np.zeros(rows.shape[0], dtype=np.uint64)
        high = np.zeros(rows.shape[0], dtype=np.uint64)
        for j in range(top_k):
            term = low_table[j + 1][ordered[j]]
            low += term
            high += high_table[j + 1][ordered[j]] + (low < term)  # the carry
        limbs = [low, high]
    if has_padding:
        for limb, shift in zip(limbs, (0, 64), strict=False):
            limb[padding] = (padding_rank >> shift) & _U64_MAX
    return limbs


def encode_sets_numpy(ids: np.ndarray, num_experts: int, fill_value: int) -> np.ndarray:
    """The set payload of ``ids`` (``[L, T, K]``, at least one row, K ≥ 1) as uint8."""
    top_k = int(ids.shape[2])
    rows = ids.reshape(-1, top_k)
    bits = rank_bits(num_experts, top_k)
    out = np.empty(-(-rows.shape[0] * bits // 8), dtype=np.uint8)
    # Chunks of a multiple of 64 rows start on a byte (even word) boundary of the stream.
    for start in range(0, rows.shape[0], _CHUNK_ROWS):
        chunk = rows[start:start + _CHUNK_ROWS]
        packed = pack_limbs(_ranks(chunk, num_experts, fill_value, ids, start), bits)
        offset = start * bits // 8
        out[offset:offset + packed.size] = packed
    return out


@lru_cache(maxsize=64)
def _inverse_table(num_experts: int, j: int) -> tuple[np.ndarray, int, int, int]:
    """A lower bound of ``max{c : C(c, j) <= r}`` looked up by the float64 bits of ``r``.

    ``r`` (below C(E, j)) maps to the key ``(bits(float(r)) >> shift) - base`` (0 at
    least): its binary exponent and top mantissa bits, so buckets are relatively narrow at
    every magnitude.  ``guesses[key]`` is the answer for the smallest ``r`` that can land
    in the bucket (rounding included), so it never exceeds the true one; ``steps`` is the
    most the true answer can lie above it, computed exactly here over every bucket.
    Returns (guesses, shift, base, steps).
    """
    mantissa_bits = min(max(num_experts.bit_length() + 1, 2), _MAX_GUESS_BITS)
    shift = 52 - mantissa_bits
    base = 1023 << mantissa_bits
    column = np.array([min(math.comb(n, j), _U64_MAX) for n in range(num_experts)],
                      dtype=np.uint64)
    largest = min(math.comb(num_experts, j), _U64_MAX)
    size = (int(np.float64(largest).view(np.int64)) >> shift) - base + 2
    starts = ((np.arange(size + 1, dtype=np.int64) + base) << shift).view(np.float64)
    # Bucket b holds float(r) in [starts[b], starts[b + 1]); float(r) >= starts[b] means
    # r >= starts[b] * (1 - 2**-53), and float(r) < starts[b + 1] means r < starts[b + 1].
    lowest = np.floor(np.minimum(starts[:-1] * (1 - 2.0**-52), 2.0**64 - 4096)) - 1
    lowest = np.maximum(lowest, 0).astype(np.uint64)
    lowest[0] = 0  # key 0 also holds r = 0 (its key is clamped up from below 0)
    highest = np.ceil(np.minimum(starts[1:], 2.0**64 - 4096)).astype(np.uint64) - np.uint64(1)
    guesses = np.searchsorted(column, lowest, side="right") - 1
    steps = int((np.searchsorted(column, highest, side="right") - 1 - guesses).max())
    guesses.flags.writeable = False
    return guesses, shift, base, steps


def unrank_column(ranks: np.ndarray, j: int, num_experts: int,
                  extended: np.ndarray) -> np.ndarray:
    """``c = max{c < E : C(c, j) <= r}`` for each r in ``ranks`` (``extended[n] = C(n, j)``
    for n <= E, saturated at n = E): a table guess, then a fixed number of single steps."""
    guesses, shift, base, steps = _inverse_table(num_experts, j)
    keys = ranks.astype(np.float64).view(np.int64) >> shift
    keys -= base
    np.maximum(keys, 0, out=keys)
    chosen = guesses[keys]
    for _ in range(steps):
        chosen += extended[chosen + 1] <= ranks
    return chosen


def _unrank_wide(low: np.ndarray, high: np.ndarray, low_column: np.ndarray,
                 high_column: np.ndarray, num_experts: int) -> np.ndarray:
    """:func:`unrank_column` for 128-bit ranks (limbs, updated in place to the rest) with
    ``C(n, j)`` given as limbs: a binary search over c in [0, E), then the subtraction
    with borrow."""
    lo = np.zeros(low.size, dtype=np.int64)  # C(lo, j) <= r always (C(0, j) = 0 for j > 0)
    hi = np.full(low.size, num_experts - 1, dtype=np.int64)
    while True:
        open_ = lo < hi
        if not open_.any():
            break
        mid = (lo + hi + 1) // 2
        mid_high, mid_low = high_column[mid], low_column[mid]
        fits = (mid_high < high) | ((mid_high == high) & (mid_low <= low))
        lo = np.where(open_ & fits, mid, lo)
        hi = np.where(open_ & ~fits, mid - 1, hi)
    term_low, term_high = low_column[lo], high_column[lo]
    borrow = (low < term_low).astype(np.uint64)
    low -= term_low
    high -= term_high + borrow
    return lo


def decode_sets_numpy(stream: np.ndarray, shape: tuple[int, int, int], num_experts: int,
                      fill_value: int, dtype: np.dtype) -> np.ndarray:
    """The ``[L, T, K]`` ids of a set payload of the right size (at least one row, K ≥ 1);
    RecordError on a rank above C(E, K)."""
    layers, tokens, top_k = shape
    count = layers * tokens
    ids = np.empty((count, top_k), dtype=dtype)
    bits = rank_bits(num_experts, top_k)
    padding_rank = math.comb(num_experts, top_k)
    extended = extended_columns(num_experts, top_k)
    binomials = binomial_columns(num_experts, top_k)
    wide_levels = [j for j in range(2, top_k + 1)
                   if min(math.comb(num_experts, j), padding_rank) - 1 > _U64_MAX]
    for start in range(0, count, _CHUNK_ROWS):
        rows = min(_CHUNK_ROWS, count - start)
        first, last = start * bits // 8, -(-(start + rows) * bits // 8)
        limbs = unpack_limbs(stream[first:last], rows, bits)
        padding_limbs = [np.uint64((padding_rank >> shift) & _U64_MAX) for shift in (0, 64)]
        if len(limbs) == 1:
            above = limbs[0] > padding_limbs[0]
            padding = limbs[0] == padding_limbs[0]
        else:
            above = (limbs[1] > padding_limbs[1]) | ((limbs[1] == padding_limbs[1])
                                                     & (limbs[0] > padding_limbs[0]))
            padding = (limbs[1] == padding_limbs[1]) & (limbs[0] == padding_limbs[0])
        if above.any():
            raise rank_too_large(stream, start + int(np.argmax(above)), num_experts, top_k)
        has_padding = bool(padding.any())
        if has_padding:
            for limb in limbs:
                limb[padding] = 0
        columns = np.empty((top_k, rows), dtype=dtype)  # contiguous per slot; one transpose
        ranks = limbs[0]
        for j in range(top_k, 1, -1):
            if j in wide_levels:
                low_table, high_table = binomial_limbs(num_experts, top_k)
                columns[j - 1] = _unrank_wide(limbs[0], limbs[1], low_table[j], high_table[j],
                                              num_experts)
                continue
            chosen = unrank_column(ranks, j, num_experts, extended[j])
            ranks -= binomials[j][chosen]
            columns[j - 1] = chosen
        columns[0] = ranks  # C(c, 1) = c
        out = ids[start:start + rows]
        out[...] = columns.T
        if has_padding:
            out[padding] = fill_value
    return ids.reshape(shape)


# ------------------------------------------------------------------ the package's signatures


def encode_sets(ids: np.ndarray, num_experts: int, fill_value: int) -> np.ndarray:
    """The set payload of ``ids`` (``[L, T, K]`` integers), as the package's ``encode_sets``."""
    assert ids.ndim == 3, ids.shape
    if payload_nbytes(int(ids.shape[0]) * int(ids.shape[1]), num_experts, int(ids.shape[2])) == 0:
        return np.zeros(0, dtype=np.uint8)
    return encode_sets_numpy(ids, num_experts, fill_value)


def decode_sets(payload: memoryview | bytes | np.ndarray, shape: tuple[int, int, int],
                num_experts: int, fill_value: int, dtype: np.dtype) -> np.ndarray:
    """The ``[L, T, K]`` ids of a set payload, as the package's ``decode_sets``."""
    layers, tokens, top_k = shape
    count = layers * tokens
    stream = np.frombuffer(payload, dtype=np.uint8)
    expected = payload_nbytes(count, num_experts, top_k)
    if stream.size != expected:
        raise RecordError(f"set payload has {stream.size} bytes, but {count} rows of "
                          f"C({num_experts}, {top_k}) ranks need {expected}")
    if count * top_k == 0:
        return np.empty(shape, dtype=dtype)
    check_trailing_bits(stream, count, rank_bits(num_experts, top_k))
    return decode_sets_numpy(stream, shape, num_experts, fill_value, np.dtype(dtype))
