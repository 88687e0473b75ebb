"""The bit stream of a ``set`` payload in NumPy: fixed-width values packed back to back.

Row ``n``'s value occupies stream bits ``[n*b, (n+1)*b)``; stream bit ``i`` is bit
``i % 8`` of byte ``i // 8``.  A value is given as 64-bit *limbs*, least significant
first: one limb when ``b <= 64``, two (the low 64 bits, then the high ``b - 64``) up to
``b = 128``; each limb is a field of at most 64 bits at a known offset, so packing is
shifts and ORs over uint64 columns.  64 rows of ``b`` bits fill exactly ``b`` words, so
rows are handled in groups of 64.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

__all__ = ["GROUP", "limb_widths", "pack_limbs", "unpack_limbs"]

GROUP = 64
"""Rows per group: 64 rows of b bits fill exactly b uint64 words."""
_U64_MAX = (1 << 64) - 1


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
