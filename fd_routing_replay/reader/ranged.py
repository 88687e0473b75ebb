"""Where a sliced read gets its byte ranges: one version of a stored record.

A store's ``open_ranges(key)`` (the local store, Redis) returns a view of one version:
``size`` (bytes stored), ``read(ranges)``, ``unchanged()`` (whether every read saw the
version the view opened) and ``close()``; None when the key is absent.  A store with only
``read_ranges(key, ranges)`` (the older capability, which third-party stores may offer:
each call reads one version) is wrapped in :class:`RangesView`: it knows no size, so
:meth:`RangesView.pin` probes the length the header promises, and from then on every read
fetches the header bytes again in the same call and compares them, so a record replaced
between the calls is noticed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["RangesView", "open_view"]


class RangesView:
    """A view over a store's ``read_ranges`` (see the module docstring)."""

    size: int | None = None

    def __init__(self, read_ranges: Callable[[str, Sequence[tuple[int, int]]], list[bytes] | None],
                 key: str) -> None:
        self._read_ranges = read_ranges
        self._key = key
        self._pinned: list[tuple[int, int]] = []
        self._expected: list[Any] = []
        self._changed = False

    def read(self, ranges: Sequence[tuple[int, int]]) -> list[bytes] | None:
        """The ranges, None when the key is absent (deleted meanwhile, once pinned)."""
        got = self._read_ranges(self._key, self._pinned + list(ranges))
        if got is None:
            self._changed = self._changed or bool(self._pinned)
            return None
        checked = got[:len(self._pinned)]
        if [bytes(part) if index == 0 else len(part) for index, part in enumerate(checked)] \
                != self._expected:
            self._changed = True
        return [bytes(part) for part in got[len(self._pinned):]]

    def pin(self, head: bytes, record_length: int) -> int:
        """Read ``head`` (the header's bytes) and the two bytes at ``record_length - 1``
        again, in one call, now and with every later read, noting a change when they
        differ; return the stored length as far as it matters: ``record_length`` when the
        value is exactly that long, one less when shorter, one more when longer."""
        self._pinned = [(0, len(head)), (record_length - 1, 2)]
        got = self._read_ranges(self._key, self._pinned)
        if got is None or bytes(got[0]) != head:
            self._changed = True                 # replaced or deleted since the header
            return record_length
        self._expected = [bytes(head), len(got[1])]
        return record_length - 1 + len(got[1])

    def unchanged(self) -> bool:
        return not self._changed

    def close(self) -> None:
        pass

    def __enter__(self) -> RangesView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_view(store: Any, key: str) -> Any:
    """A view of ``key``'s value (``open_ranges``, else :class:`RangesView` over
    ``read_ranges``); None when the store reads no ranges or the key is absent."""
    open_ranges = getattr(store, "open_ranges", None)
    if open_ranges is not None:
        return open_ranges(key)
    read_ranges = getattr(store, "read_ranges", None)
    return None if read_ranges is None else RangesView(read_ranges, key)
