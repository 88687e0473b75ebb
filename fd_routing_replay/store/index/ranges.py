"""Lexicographic ranges of the prefix index: which ``ZRANGEBYLEX`` ranges hold the keys a
prefix matches, and sorted, bounded reads of a range over every bucket.

Boundary-safe lookup (:func:`fd_routing_replay.keys.prefix_matches`): a prefix ``p`` that
does not end with a separator selects the member ``p`` itself plus two contiguous ranges,
``[p:`` … ``(p;`` and ``[p_`` … ``(p`` + backtick (``;`` and the backtick are the bytes
right after ``:`` and ``_``); a prefix ending with a separator selects ``[p`` … ``(p\\xff``
(0xFF never occurs in UTF-8).  ``x:1`` therefore never reaches ``x:10``.  Because
``p < p:… < p_…``, reading the three ranges in that order yields sorted keys.

Ranges are read in pages of ``batch`` members with a cursor (``(last``); over several
buckets the buckets' first pages go in one pipelined round trip and are merged, sorted and
deduplicated (mid-migration a key may be in two sets).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from fd_routing_replay.keys import SEPARATORS
from fd_routing_replay.store.index.members import raw_member

__all__ = ["Span", "merged_pages", "prefix_ranges"]

_NEXT_BYTE = {sep.encode(): bytes([ord(sep) + 1]) for sep in SEPARATORS}  # ":"->";", "_"->"`"
_PAST_UTF8 = b"\xff"  # greater than any byte of valid UTF-8


def prefix_ranges(prefix: str) -> list[tuple[bytes, bytes]]:
    """The ``ZRANGEBYLEX`` (min, max) ranges holding exactly the keys ``prefix`` matches.

    Sorted: every key of an earlier range is smaller than every key of a later one.
    """
    raw = prefix.encode("utf-8")
    if prefix.endswith(SEPARATORS):
        return [(b"[" + raw, b"(" + raw + _PAST_UTF8)]
    ranges = [(b"[" + raw, b"[" + raw)]
    for sep in sorted(_NEXT_BYTE):
        ranges.append((b"[" + raw + sep, b"(" + raw + _NEXT_BYTE[sep]))
    return ranges


class Span:
    """One lexicographic span a prefix delete pages through.

    For ``p`` without a trailing separator the span is ``[p:`` … ``(p``` — both separator
    ranges in one command — and its members are filtered to those starting with ``p:`` or
    ``p_``.  The keys in between (``p;`` … ``p^``, e.g. ``p@x``, ``pA``) are rare; when a
    full page ends among them, the next page jumps straight to ``[p_``, so at most one
    page per prefix is spent on them.  For ``p`` ending with a separator the span is the
    single range ``[p`` … ``(p\\xff``, all of it matching.
    """

    __slots__ = ("prefix", "name", "low", "high", "starts", "gap_end")

    def __init__(self, prefix: str, name: str, low: bytes, high: bytes,
                 starts: tuple[bytes, ...], gap_end: bytes | None) -> None:
        self.prefix, self.name, self.low, self.high = prefix, name, low, high
        self.starts, self.gap_end = starts, gap_end

    @classmethod
    def of(cls, prefix: str, name: str) -> Span:
        """The span of ``prefix`` in the index set (bucket) ``name``."""
        raw = prefix.encode("utf-8")
        if prefix.endswith(SEPARATORS):
            return cls(prefix, name, b"[" + raw, b"(" + raw + _PAST_UTF8, (raw,), None)
        colon, under = raw + b":", raw + b"_"
        return cls(prefix, name, b"[" + colon, b"(" + raw + _NEXT_BYTE[b"_"],
                   (colon, under), b"[" + under)

    def after(self, last: bytes) -> Span:
        """The rest of the span after a full page ending with ``last``."""
        if self.gap_end is not None and not last.startswith(self.starts):
            # ``last`` lies between the ``p:`` and ``p_`` ranges: skip the rest of the gap.
            return Span(self.prefix, self.name, self.gap_end, self.high, self.starts, None)
        return Span(self.prefix, self.name, b"(" + last, self.high, self.starts,
                    self.gap_end)


def merged_pages(client: Any, names: Sequence[str], low: bytes, high: bytes, batch: int
                 ) -> Iterator[list[bytes]]:
    """The members of ``[low, high]`` over the sets ``names``, sorted, deduplicated
    (mid-migration a key may be in two sets), in pages of at most ``batch``."""
    if len(names) == 1:
        for page in _range_pages(client, names[0], low, high, batch):
            yield [raw_member(member) for member in page]
        return
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.zrangebylex(name, low, high, start=0, num=batch)
    firsts = pipe.execute()
    streams = [itertools.chain.from_iterable(_continued(client, name, first, high, batch))
               for name, first in zip(names, firsts, strict=True)]
    page: list[bytes] = []
    last = None
    for member in heapq.merge(*streams):
        if member == last:
            continue
        last = member
        page.append(member)
        if len(page) == batch:
            yield page
            page = []
    if page:
        yield page


def _continued(client: Any, name: str, first: list[Any], high: bytes, batch: int
               ) -> Iterator[list[bytes]]:
    first = [raw_member(member) for member in first]
    yield first
    if len(first) == batch:
        for page in _range_pages(client, name, b"(" + first[-1], high, batch):
            yield [raw_member(member) for member in page]


def _range_pages(client: Any, name: str, low: bytes, high: bytes, batch: int
                 ) -> Iterator[list[bytes | str]]:
    while True:
        members = client.zrangebylex(name, low, high, start=0, num=batch)
        if not members:
            return
        yield members
        if len(members) < batch:
            return
        low = b"(" + raw_member(members[-1])
