"""The prefix-bucket index: every key of a namespace in one lexicographic sorted set.

Redis keeps the index beside the data, so deleting a rollout, a trajectory or a whole
training step costs ``O(log N + matched)`` instead of listing every key (what P2PStore's
``delete_prefix_batch`` does).  Design, costs and measured memory: docs/design-index.md.

Structure: one sorted set per namespace, ``{key_prefix}:idx:{namespace}`` — the braces
are a Redis Cluster hash tag, so the whole index of a namespace lives in one slot and every
command touches exactly one slot (no multi-slot commands, no scripts).  Members are the
UTF-8 store keys, all with score 0, so ``ZRANGEBYLEX`` orders them bytewise, which for
UTF-8 is code-point order (the order of Python's ``sorted``).

Boundary-safe lookup (:func:`fd_routing_replay.keys.prefix_matches`): a prefix ``p`` that
does not end with a separator selects the member ``p`` itself plus two contiguous ranges,
``[p:`` … ``(p;`` and ``[p_`` … ``(p`` + backtick (``;`` and the backtick are the bytes
right after ``:`` and ``_``); a prefix ending with a separator selects ``[p`` … ``(p\\xff`` (0xFF never occurs
in UTF-8).  ``x:1`` therefore never reaches ``x:10``.  Because ``p < p:… < p_…``, reading
the three ranges in that order yields sorted keys.

Every command is bounded: ranges are read in pages of ``batch`` members with a cursor
(``(last``), members are added and removed ``batch`` at a time, so no single command
works on more than ``batch`` members whatever N is.

Crash consistency is the caller's ordering (see :meth:`PrefixIndex.delete_prefixes`):
payload first on put, payload first on delete, so a crash leaves at worst an unindexed
payload or an index entry without payload; :mod:`fd_routing_replay.store.fsck` repairs both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from fd_routing_replay.keys import SEPARATORS, check_namespace, check_prefix

DEFAULT_BATCH = 1000
"""Members per Redis command: ~0.3-1 ms of server time at any N (docs/design-index.md)."""

PayloadDeleter = Callable[[list[str]], object]
"""Deletes the payloads of some keys (return value ignored by the index)."""

_NEXT_BYTE = {sep.encode(): bytes([ord(sep) + 1]) for sep in SEPARATORS}  # ":"->";", "_"->"`"
_PAST_UTF8 = b"\xff"  # greater than any byte of valid UTF-8


def _text(member: bytes | str) -> str:
    return member.decode("utf-8") if isinstance(member, bytes) else member


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


class PrefixIndex:
    """All keys of one namespace, ordered, with boundary-safe prefix lookups.

    ``client`` is a redis-py ``Redis`` or ``RedisCluster`` (any ``decode_responses``).
    Keys are not validated here — stores validate with ``check_key`` before indexing;
    prefixes are validated with ``check_prefix`` (the empty prefix is rejected).
    """

    def __init__(self, client: Any, namespace: str, *, key_prefix: str = "rr",
                 batch: int = DEFAULT_BATCH) -> None:
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        self.client = client
        self.namespace = check_namespace(namespace)
        self.batch = batch
        self.key = f"{key_prefix}:idx:{{{self.namespace}}}"

    # -- writes -----------------------------------------------------------------------
    def add(self, keys: Iterable[str], pipeline: Any = None) -> None:
        """Index ``keys`` (idempotent).  With ``pipeline``, queue the commands on it instead
        of running them (the caller executes it, e.g. after the payload writes)."""
        target = pipeline if pipeline is not None else self.client.pipeline(transaction=False)
        queued = False
        for page in _pages(keys, self.batch):
            target.zadd(self.key, {key.encode("utf-8"): 0 for key in page})
            queued = True
        if pipeline is None and queued:
            target.execute()

    def remove(self, keys: Iterable[str], pipeline: Any = None) -> int:
        """Drop ``keys`` from the index; return how many were indexed (0 when pipelined)."""
        target = pipeline if pipeline is not None else self.client.pipeline(transaction=False)
        queued = False
        for page in _pages(keys, self.batch):
            target.zrem(self.key, *(key.encode("utf-8") for key in page))
            queued = True
        if pipeline is not None or not queued:
            return 0
        return sum(target.execute())

    def _remove_counted(self, owner: dict[str, str], counts: dict[str, int],
                        size: int) -> None:
        """Remove the keys of ``owner`` (key -> prefix), adding to ``counts[prefix]``.

        One ``ZREM`` per page, all pages in one pipeline.  When it removes the whole page (always, unless another
        client removed some of these entries meanwhile) the count per prefix is exact; after
        such a race the page's total is still exact and is credited to its prefixes in order.
        """
        pages = list(_pages(list(owner), size))
        pipe = self.client.pipeline(transaction=False)
        for page in pages:
            pipe.zrem(self.key, *(key.encode("utf-8") for key in page))
        for page, removed in zip(pages, pipe.execute(), strict=True):
            for key in page[:int(removed)]:
                counts[owner[key]] += 1

    # -- reads ---------------------------------------------------------------------------
    def contains(self, key: str) -> bool:
        return self.client.zscore(self.key, key.encode("utf-8")) is not None

    def __len__(self) -> int:
        return int(self.client.zcard(self.key))

    def count(self, prefix: str) -> int:
        """How many indexed keys ``prefix`` matches: O(log N), whatever the match size."""
        ranges = prefix_ranges(check_prefix(prefix))
        pipe = self.client.pipeline(transaction=False)
        for low, high in ranges:
            pipe.zlexcount(self.key, low, high)
        return int(sum(pipe.execute()))

    def match_pages(self, prefix: str, batch: int | None = None) -> Iterator[list[str]]:
        """Pages (sorted, at most ``batch`` keys each) of the keys ``prefix`` matches.

        Each page is one ``ZRANGEBYLEX … LIMIT 0 batch`` starting after the previous page,
        so removing a page's keys while iterating is safe.
        """
        for low, high in prefix_ranges(check_prefix(prefix)):
            yield from self._range_pages(low, high, batch or self.batch)

    def match(self, prefix: str, batch: int | None = None) -> Iterator[str]:
        """The keys ``prefix`` matches, sorted, read ``batch`` at a time."""
        for page in self.match_pages(prefix, batch):
            yield from page

    def all_pages(self, batch: int | None = None) -> Iterator[list[str]]:
        """Every indexed key of the namespace, sorted, in pages."""
        return self._range_pages(b"-", b"+", batch or self.batch)

    def all(self, batch: int | None = None) -> Iterator[str]:
        """Every indexed key of the namespace, sorted."""
        for page in self.all_pages(batch):
            yield from page

    def _range_pages(self, low: bytes, high: bytes, batch: int) -> Iterator[list[str]]:
        while True:
            members = self.client.zrangebylex(self.key, low, high, start=0, num=batch)
            if not members:
                return
            yield [_text(member) for member in members]
            if len(members) < batch:
                return
            last = members[-1]
            low = b"(" + (last if isinstance(last, bytes) else last.encode("utf-8"))

    # -- deletes in crash-safe order ------------------------------------------------------
    def delete_prefix(self, prefix: str, delete_payloads: PayloadDeleter,
                      batch: int | None = None) -> int:
        """Delete every key ``prefix`` matches (see :meth:`delete_prefixes`); return the count."""
        return self.delete_prefixes([prefix], delete_payloads, batch)[prefix]

    def delete_prefixes(self, prefixes: Iterable[str], delete_payloads: PayloadDeleter,
                        batch: int | None = None, ranges_per_round: int = 128
                        ) -> dict[str, int]:
        """Delete every key each prefix matches: payloads first, then their index entries.

        ``delete_payloads(keys)`` removes the payloads of one round of keys (its return
        value is ignored).  Index entries are removed only after it returns, so a crash in
        between leaves index entries without payload (``fsck`` drops them), never an
        unindexed payload that no prefix delete could find.

        Round trips are shared: each round reads the exact-key matches of its prefixes
        with one ``ZMSCORE`` and the next page of up to ``ranges_per_round``
        lexicographic ranges in the same pipeline, deletes all their payloads in one call
        and their entries with one ``ZREM`` per page, so 64 small prefixes cost three round
        trips, not 192.  The counts are index entries this call removed, so two concurrent
        deletes never count a key twice (see :meth:`_remove_counted`); a key matched by
        several prefixes is counted under one of them.
        """
        size = batch or self.batch
        checked = [check_prefix(p) for p in ([prefixes] if isinstance(prefixes, str)
                                             else prefixes)]
        counts = dict.fromkeys(checked, 0)
        exact = [p for p in counts if not p.endswith(SEPARATORS)]
        pending = [_Span.of(prefix) for prefix in counts]
        while exact or pending:
            round_exact, exact = exact[:ranges_per_round], exact[ranges_per_round:]
            round_spans, pending = pending[:ranges_per_round], pending[ranges_per_round:]
            pipe = self.client.pipeline(transaction=False)
            if round_exact:
                pipe.zmscore(self.key, [p.encode("utf-8") for p in round_exact])
            for span in round_spans:
                pipe.zrangebylex(self.key, span.low, span.high, start=0, num=size)
            replies = pipe.execute()
            owner: dict[str, str] = {}
            if round_exact:
                for prefix, score in zip(round_exact, replies.pop(0), strict=True):
                    if score is not None:
                        owner.setdefault(prefix, prefix)
            for span, members in zip(round_spans, replies, strict=True):
                raw_members = [m if isinstance(m, bytes) else m.encode("utf-8")
                               for m in members]
                for member in raw_members:
                    if member.startswith(span.starts):
                        owner.setdefault(member.decode("utf-8"), span.prefix)
                if len(raw_members) == size:  # more in this span
                    pending.append(span.after(raw_members[-1]))
            if not owner:
                continue
            delete_payloads(list(owner))
            self._remove_counted(owner, counts, size)
        return counts

    def clear(self, delete_payloads: PayloadDeleter | None = None,
              batch: int | None = None) -> int:
        """Empty the namespace's index, page by page, deleting payloads first when given.

        Returns the index entries removed.
        """
        removed = 0
        for page in self.all_pages(batch):
            if delete_payloads is not None:
                delete_payloads(page)
            removed += self.remove(page)
        return removed


class _Span:
    """One lexicographic span a prefix delete pages through.

    For ``p`` without a trailing separator the span is ``[p:`` … ``(p``` — both separator
    ranges in one command — and its members are filtered to those starting with ``p:`` or
    ``p_``.  The keys in between (``p;`` … ``p^``, e.g. ``p@x``, ``pA``) are rare; when a
    full page ends among them, the next page jumps straight to ``[p_``, so at most one
    page per prefix is spent on them.  For ``p`` ending with a separator the span is the
    single range ``[p`` … ``(p\xff``, all of it matching.
    """

    __slots__ = ("prefix", "low", "high", "starts", "gap_end")

    def __init__(self, prefix: str, low: bytes, high: bytes, starts: tuple[bytes, ...],
                 gap_end: bytes | None) -> None:
        self.prefix, self.low, self.high = prefix, low, high
        self.starts, self.gap_end = starts, gap_end

    @classmethod
    def of(cls, prefix: str) -> _Span:
        raw = prefix.encode("utf-8")
        if prefix.endswith(SEPARATORS):
            return cls(prefix, b"[" + raw, b"(" + raw + _PAST_UTF8, (raw,), None)
        colon, under = raw + b":", raw + b"_"
        return cls(prefix, b"[" + colon, b"(" + raw + _NEXT_BYTE[b"_"], (colon, under),
                   b"[" + under)

    def after(self, last: bytes) -> _Span:
        """The rest of the span after a full page ending with ``last``."""
        if self.gap_end is not None and not last.startswith(self.starts):
            # ``last`` lies between the ``p:`` and ``p_`` ranges: skip the rest of the gap.
            return _Span(self.prefix, self.gap_end, self.high, self.starts, None)
        return _Span(self.prefix, b"(" + last, self.high, self.starts, self.gap_end)


def _pages(keys: Iterable[str], size: int) -> Iterator[list[str]]:
    if isinstance(keys, str):
        keys = [keys]
    page: list[str] = []
    for key in keys:
        page.append(key)
        if len(page) == size:
            yield page
            page = []
    if page:
        yield page
