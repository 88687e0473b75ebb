"""The ``set`` payload encoding of rr-v1: each token-layer's top-k as a set, bit-packed.

Routing replay needs *which* experts a token went to in a layer, not in which order the
router ranked them (the trainer recomputes the weights from its own router scores).  A
set of ``k`` distinct ids out of ``E`` carries log2 C(E, k) bits; the ``plain`` encoding
spends ``k`` whole bytes (or more) on it.  This module stores each row — one token in one
layer, ``k`` ids — as one integer, the row's rank in the combinatorial number system,
in a fixed width of ``b = C(E, k).bit_length()`` bits, and packs those integers back to
back into a little-endian bit stream.  The spare value ``C(E, k)`` (one past the largest
rank) marks a *padding row*: a row whose ``k`` slots all hold the record's fill value.

Rank of the sorted set ``c_0 < c_1 < ... < c_{k-1}`` (each in ``[0, E)``)::

    rank = C(c_0, 1) + C(c_1, 2) + ... + C(c_{k-1}, k)          (C(n, j) = 0 when n < j)

which enumerates the C(E, k) sets as 0 .. C(E, k) - 1.  Decoding picks, for j = k .. 1,
the largest ``c`` with ``C(c, j) <= rest`` and subtracts it (greedy), giving the ids in
ascending order.  Row ``n`` (C order over ``[L, T]``) occupies stream bits
``[n*b, (n+1)*b)``; stream bit ``i`` is bit ``i % 8`` of payload byte ``i // 8``; the
payload is ``ceil(L*T*b / 8)`` bytes and the unused high bits of its last byte are zero.
docs/record-format.md is the normative description.

Everything is vectorised NumPy over uint64 (sort, table look-ups, shifts): the width is
limited to 64 bits, i.e. ``C(E, k) < 2**64`` (E = 256, k = 8 needs 49 bits).
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from fd_routing_replay.errors import RecordError

__all__ = ["MAX_RANK_BITS", "MAX_SET_EXPERTS", "SetEncodingError", "decode_sets", "encode_sets", "payload_nbytes",
           "rank_bits"]

MAX_RANK_BITS = 64
"""Widest rank this implementation handles (one uint64 per row)."""
MAX_SET_EXPERTS = 1 << 16
"""Most experts a set record may have (bounds the lookup tables a corrupt header can ask for)."""
_MAX_GUESS_BITS = 12
"""Mantissa bits of the unranking lookup key, at most (≤ 2 MiB per table)."""
_U64_MAX = (1 << 64) - 1
_GROUP = 64
"""Rows are packed in groups of 64: 64 rows of b bits fill exactly b uint64 words."""
_CHUNK_ROWS = 1 << 16
"""Rows encoded or decoded per pass, so temporaries stay a few MiB whatever the record."""


class SetEncodingError(RecordError):
    """The ids cannot be stored as sets (a row that is neither k distinct expert ids nor
    all fill, or C(E, k) too large): the record can still be written ``plain``."""


def rank_bits(num_experts: int, top_k: int) -> int:
    """Bits per row: ``C(num_experts, top_k).bit_length()`` (ranks plus the padding value).

    SetEncodingError when ``top_k`` exceeds ``num_experts`` or the width exceeds
    :data:`MAX_RANK_BITS`.
    """
    if not 0 <= top_k <= num_experts:
        raise SetEncodingError(f"set encoding: top_k {top_k} must be in [0, num_experts="
                               f"{num_experts}] (a row holds {top_k} distinct expert ids)")
    if num_experts > MAX_SET_EXPERTS:
        raise SetEncodingError(f"set encoding: num_experts {num_experts} is above the "
                               f"{MAX_SET_EXPERTS} it supports; use capture.encoding: plain")
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


@lru_cache(maxsize=16)
def _binomial_columns(num_experts: int, top_k: int) -> np.ndarray:
    """``columns[j, n] = C(n, j)`` for j in [0, k], n in [0, E), as uint64, saturated at
    2**64 - 1 (saturated entries are never reached by a valid rank; columns stay sorted)."""
    columns = np.empty((top_k + 1, num_experts), dtype=np.uint64)
    for j in range(top_k + 1):
        columns[j] = [min(math.comb(n, j), _U64_MAX) for n in range(num_experts)]
    columns.flags.writeable = False
    return columns


@lru_cache(maxsize=16)
def _extended_columns(num_experts: int, top_k: int) -> np.ndarray:
    """:func:`_binomial_columns` with one saturated entry appended to each column (n = E),
    so ``C(c + 1, j)`` can be looked up for every c < E."""
    extended = np.full((top_k + 1, num_experts + 1), _U64_MAX, dtype=np.uint64)
    extended[:, :num_experts] = _binomial_columns(num_experts, top_k)
    extended.flags.writeable = False
    return extended


def _word_plan(bits: int) -> list[tuple[int, int, bool]]:
    """For row j of a 64-row group: (first word, shift, spills into the next word)."""
    return [(j * bits >> 6, j * bits & 63, (j * bits & 63) + bits > 64) for j in range(_GROUP)]


def _pack(values: np.ndarray, bits: int) -> np.ndarray:
    """``values`` (uint64, each < 2**bits) as a packed little-endian bit stream (uint8)."""
    count = values.size
    groups = -(-count // _GROUP)
    padded = np.zeros(groups * _GROUP, dtype=np.uint64)
    padded[:count] = values
    columns = np.ascontiguousarray(padded.reshape(groups, _GROUP).T)  # [j, g] = row 64g + j
    words = np.zeros((bits, groups), dtype=np.uint64)
    for j, (word, shift, spills) in enumerate(_word_plan(bits)):
        column = columns[j]
        words[word] |= column << np.uint64(shift)
        if spills:
            words[word + 1] |= column >> np.uint64(64 - shift)
    stream = np.ascontiguousarray(words.T).astype("<u8", copy=False).reshape(-1).view(np.uint8)
    return stream[: -(-count * bits // 8)]


def _unpack(stream: np.ndarray, count: int, bits: int) -> np.ndarray:
    """The ``count`` values of ``bits`` bits each in ``stream`` (uint8), as uint64."""
    groups = -(-count // _GROUP)
    padded = np.zeros(groups * bits * 8, dtype=np.uint8)
    padded[: stream.size] = stream
    words = np.ascontiguousarray(padded.view("<u8").reshape(groups, bits).T)
    mask = np.uint64(_U64_MAX >> (64 - bits))
    columns = np.empty((_GROUP, groups), dtype=np.uint64)
    for j, (word, shift, spills) in enumerate(_word_plan(bits)):
        column = words[word] >> np.uint64(shift)
        if spills:
            column |= words[word + 1] << np.uint64(64 - shift)
        np.bitwise_and(column, mask, out=columns[j])
    return columns.T.reshape(-1)[:count]


def _describe_row(ids: np.ndarray, row: int) -> str:
    layer, token = divmod(row, ids.shape[1]) if ids.shape[1] else (row, 0)
    return f"[layer {layer}, token {token}] = {ids.reshape(-1, ids.shape[2])[row].tolist()}"


@lru_cache(maxsize=16)
def _sorting_network(size: int) -> tuple[tuple[int, int], ...]:
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
    for low, high in _sorting_network(len(columns)):
        smaller = np.minimum(columns[low], columns[high])
        np.maximum(columns[low], columns[high], out=columns[high])
        columns[low] = smaller
    return columns


def _ranks(rows: np.ndarray, num_experts: int, fill_value: int, binomials: np.ndarray,
           ids: np.ndarray, first_row: int) -> np.ndarray:
    """The rank of each row of ``rows`` ([n, k]); the padding value for all-fill rows."""
    top_k = rows.shape[1]
    ordered = _sorted_columns(rows)
    padding = (ordered[0] == fill_value) & (ordered[-1] == fill_value)
    valid = ordered[-1] < num_experts
    for j in range(1, top_k):
        valid &= ordered[j] != ordered[j - 1]
    bad = ~(valid | padding)
    if bad.any():
        row = first_row + int(np.argmax(bad))
        raise SetEncodingError(
            f"set encoding: row {_describe_row(ids, row)} is neither {top_k} distinct expert "
            f"ids below num_experts {num_experts} nor a padding row (all fill value "
            f"{fill_value}); such a record can only be written plain")
    has_padding = bool(padding.any())
    if has_padding:  # any in-range index will do: the rank is overwritten below
        for column in ordered:
            np.minimum(column, num_experts - 1, out=column)
    ranks = binomials[1][ordered[0]]
    for j in range(1, top_k):
        ranks += binomials[j + 1][ordered[j]]
    if has_padding:
        ranks[padding] = math.comb(num_experts, top_k)
    return ranks


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


def _unrank_column(ranks: np.ndarray, j: int, num_experts: int,
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
    rows = ids.reshape(-1, top_k)
    bits = rank_bits(num_experts, top_k)
    binomials = _binomial_columns(num_experts, top_k)
    out = np.empty(total, dtype=np.uint8)
    # Chunks of a multiple of 64 rows start on a byte (even word) boundary of the stream.
    for start in range(0, rows.shape[0], _CHUNK_ROWS):
        chunk = rows[start:start + _CHUNK_ROWS]
        packed = _pack(_ranks(chunk, num_experts, fill_value, binomials, ids, start), bits)
        offset = start * bits // 8
        out[offset:offset + packed.size] = packed
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
    ids = np.empty((count, top_k), dtype=dtype)
    if ids.size == 0:
        return ids.reshape(shape)
    bits = rank_bits(num_experts, top_k)
    used = count * bits
    if used % 8 and int(stream[-1]) >> (used % 8):
        raise RecordError(f"set payload: non-zero bits after the last of {count} rows "
                          "(corrupt or truncated payload)")
    binomials = _binomial_columns(num_experts, top_k)
    extended = _extended_columns(num_experts, top_k)
    padding_rank = math.comb(num_experts, top_k)
    for start in range(0, count, _CHUNK_ROWS):
        rows = min(_CHUNK_ROWS, count - start)
        first, last = start * bits // 8, -(-(start + rows) * bits // 8)
        ranks = _unpack(stream[first:last], rows, bits)
        if int(ranks.max()) > padding_rank:
            row = start + int(np.argmax(ranks > padding_rank))
            raise RecordError(
                f"set payload: row {row} holds rank {int(ranks[row - start])}, above the "
                f"largest C({num_experts}, {top_k}) = {padding_rank} (corrupt payload)")
        padding = ranks == padding_rank
        has_padding = bool(padding.any())
        if has_padding:
            ranks[padding] = 0
        columns = np.empty((top_k, rows), dtype=dtype)  # contiguous per slot; one transpose
        for j in range(top_k, 1, -1):
            column = binomials[j]
            chosen = _unrank_column(ranks, j, num_experts, extended[j])
            ranks -= column[chosen]
            columns[j - 1] = chosen
        columns[0] = ranks  # C(c, 1) = c
        out = ids[start:start + rows]
        out[...] = columns.T
        if has_padding:
            out[padding] = fill_value
    return ids.reshape(shape)
