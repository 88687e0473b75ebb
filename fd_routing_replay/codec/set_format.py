"""What a ``set`` payload is, whatever code packs it: limits, size, errors, shared checks.

Its width and byte size, the error type, and the checks every implementation shares.

docs/record-format.md ("Payload encoding set") is the normative description; the NumPy
reference (:mod:`fd_routing_replay.codec.set_numpy`) and the compiled codec
(:mod:`fd_routing_replay.codec.setcodec`) both implement it, bit for bit.
"""

from __future__ import annotations

import math

import numpy as np

from fd_routing_replay.errors import RecordError

__all__ = ["MAX_RANK_BITS", "MAX_SET_EXPERTS", "MAX_SET_TABLE", "SetEncodingError",
           "check_trailing_bits", "describe_row", "not_a_set", "payload_nbytes", "rank_bits",
           "rank_too_large", "row_value"]

MAX_RANK_BITS = 128
"""Widest rank supported: two 64-bit words per row (``C(E, k) < 2**128``).  Ranks up to
64 bits keep the layout they always had (the format does not depend on the width)."""
MAX_SET_EXPERTS = 1 << 16
"""Most experts a set record may have (bounds the lookup tables a corrupt header can ask for)."""
MAX_SET_TABLE = 1 << 22
"""Most binomials ``(top_k + 1) * num_experts`` the tables may hold (64 MiB at 128 bits),
so a header cannot ask for gigabytes; only ``top_k`` close to a huge ``num_experts``
(e.g. E = 65,536, k > 63, whose ranks are far wider than 128 bits anyway) is refused."""


class SetEncodingError(RecordError):
    """The ids cannot be stored as sets (a row that is neither k distinct expert ids nor
    all fill, or C(E, k) too large): the record can still be written ``plain``."""


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
