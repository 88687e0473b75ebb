"""Byte ranges of one version of a Redis record: the ``open_ranges`` capability.

A sliced read needs the record's header before it knows which payload bytes to ask for,
so it reads in two steps; a put between them must not give it the header of one version
and the payload of another.  :func:`open_record_ranges` ``WATCH``es the record's HASH,
reads its chunk count, size and first chunk, and serves ranges chunk by chunk
(:class:`RecordRangeView`); :meth:`RecordRangeView.unchanged` then runs an (almost empty)
``MULTI``/``EXEC``, which Redis refuses when the HASH changed since the ``WATCH``: the
reader reads again.  A chunk is read whole and at most once per view.  Records whose
fields do not add up are read whole (:class:`BytesRangeView`), which reports them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

from fd_routing_replay.store.redis.records import COUNT_FIELD, SIZE_FIELD, decimal

__all__ = ["BytesRangeView", "RecordRangeView", "open_record_ranges"]

Translate = Callable[[str], contextlib.AbstractContextManager[None]]


class BytesRangeView:
    """Ranges of a value already in memory (always one version)."""

    def __init__(self, value: bytes | memoryview) -> None:
        self._value = memoryview(value).cast("B")
        self.size = self._value.nbytes

    def read(self, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        return [bytes(self._value[offset:offset + max(length, 0)]) for offset, length in ranges]

    def unchanged(self) -> bool:
        return True

    def close(self) -> None:
        self._value.release()

    def __enter__(self) -> BytesRangeView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RecordRangeView:
    """Ranges of a record HASH under ``WATCH``: see the module docstring.

    ``size`` is the record's size field; ``read`` returns short bytes where a chunk is
    missing or not of the length the size and chunk count make (a record replaced
    meanwhile, which :meth:`unchanged` then tells, or a damaged one)."""

    def __init__(self, pipe: Any, pkey: str, key: str, count: int, size: int, first: bytes,
                 translate: Translate) -> None:
        self._pipe = pipe
        self._pkey = pkey
        self._key = key
        self._count = count
        self.size = size
        self._chunk = len(first)
        self._chunks: dict[int, bytes] = {0: first}
        self._translate = translate
        self._verdict: bool | None = None

    def _expected(self, number: int) -> int:
        return self._chunk if number < self._count - 1 else self.size - number * self._chunk

    def read(self, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        if self._verdict is not None:
            raise RuntimeError("read after unchanged(): open the ranges again")
        chunk, size = self._chunk, self.size
        spans = [(offset, min(offset + max(length, 0), size)) for offset, length in ranges]
        wanted = sorted({number for start, end in spans if end > start
                         for number in range(start // chunk, (end - 1) // chunk + 1)}
                        - self._chunks.keys())
        if wanted:
            with self._translate(f"get {self._key!r}"):
                values = self._pipe.hmget(self._pkey, [str(n).encode() for n in wanted])
            for number, value in zip(wanted, values, strict=True):
                self._chunks[number] = value if value is not None and \
                    len(value) == self._expected(number) else b""
        out = []
        for start, end in spans:
            pieces = [self._chunks[number][max(start - number * chunk, 0):end - number * chunk]
                      for number in range(start // chunk, (end - 1) // chunk + 1)] \
                if end > start else []
            out.append(b"".join(pieces))
        return out

    def unchanged(self) -> bool:
        """Whether the record is still the version the view opened (one ``MULTI``/``EXEC``
        under the ``WATCH``); answered once, later calls repeat the answer."""
        if self._verdict is None:
            from redis.exceptions import WatchError

            with self._translate(f"get {self._key!r}"):
                try:
                    self._pipe.multi()
                    self._pipe.exists(self._pkey)
                    self._pipe.execute()
                    self._verdict = True
                except WatchError:
                    self._verdict = False
        return self._verdict

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._pipe.reset()                  # UNWATCH, connection back to the pool

    def __enter__(self) -> RecordRangeView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_record_ranges(client: Any, pkey: str, key: str, translate: Translate,
                       read_whole: Callable[[str], bytes | None]
                       ) -> RecordRangeView | BytesRangeView | None:
    """A view of the record HASH ``pkey`` (store key ``key``), None when absent: two round
    trips (``WATCH``, then ``HMGET n s 0``)."""
    pipe = client.pipeline(transaction=True)
    try:
        with translate(f"get {key!r}"):
            pipe.watch(pkey)
            count, size, first = pipe.hmget(pkey, [COUNT_FIELD, SIZE_FIELD, b"0"])
    except BaseException:
        with contextlib.suppress(Exception):
            pipe.reset()
        raise
    count, size = decimal(count), decimal(size)
    if count is not None and size is not None and count >= 1 and first and \
            (count - 1) * len(first) < size <= count * len(first) and \
            (count > 1 or size == len(first)):
        return RecordRangeView(pipe, pkey, key, count, size, first, translate)
    with contextlib.suppress(Exception):
        pipe.reset()
    value = read_whole(key)            # absent, empty, malformed or replaced meanwhile
    return None if value is None else BytesRangeView(value)
