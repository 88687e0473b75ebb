"""The prefix-bucket index: every key of a namespace in one lexicographic sorted set.

Redis keeps the index beside the data, so deleting a rollout, a trajectory or a whole
training step costs ``O(log N + matched)`` instead of listing every key (what P2PStore's
``delete_prefix_batch`` does).  Design, costs and measured memory: docs/design-index.md.

Structure: ``B`` lexicographic sorted sets per namespace (*buckets*).  With ``B = 1`` (the
default) the one set is ``{key_prefix}:idx:{namespace}``; with ``B > 1`` bucket ``i`` is
``{key_prefix}:idx:{namespace#i.salt}`` (the salt spreads the
buckets' cluster slots evenly).  The braces are a Redis Cluster hash tag, one per
bucket, so a cluster spreads the buckets over its nodes and every index command touches
exactly one slot (no multi-slot commands, no scripts).  A key's bucket is a CRC32 of its
rollout base (:func:`rollout_base`: the key without ``:turn:segment`` and ``_layer``), so
every turn, segment and layer of a rollout shares one bucket.  Exact-key operations (put,
delete, exists) touch one bucket; prefix operations read every bucket, pipelined (bases may
contain ``:``, so a rollout's prefix also matches rollouts whose base extends it, in other
buckets), and merge the sorted pages.  The bucket count is recorded in
``{key_prefix}:idxmeta:{namespace}`` (a HASH; absent = one bucket) and the recorded layout
wins over the configured one; :meth:`PrefixIndex.migrate` moves entries to another count
(``fd-rr fsck --migrate-index``), and while old layouts hold entries they are read too.
Members are the UTF-8 store keys, all with score 0, so ``ZRANGEBYLEX`` orders them
bytewise, which for UTF-8 is code-point order (the order of Python's ``sorted``).

Boundary-safe lookup (:func:`fd_routing_replay.keys.prefix_matches`): a prefix ``p`` that
does not end with a separator selects the member ``p`` itself plus two contiguous ranges,
``[p:`` … ``(p;`` and ``[p_`` … ``(p`` + backtick (``;`` and the backtick are the bytes
right after ``:`` and ``_``); a prefix ending with a separator selects ``[p`` … ``(p\\xff`` (0xFF never occurs
in UTF-8).  ``x:1`` therefore never reaches ``x:10``.  Because ``p < p:… < p_…``, reading
the three ranges in that order yields sorted keys.

Every command is bounded: ranges are read in pages of ``batch`` members with a cursor
(``(last``), members are added and removed at most ``write_batch`` at a time (several
commands per page, one round trip), so no single command works on more than ``batch``
members whatever N is, and no write on more than ``write_batch``.

Members that are not valid store keys (not UTF-8, or breaking :func:`~fd_routing_replay.keys.check_key`:
written by something else, or by hand) are never returned and never acted on: reads and
deletes skip them with a warning, and ``fd-rr fsck`` reports them and ``--repair`` drops them.

Puts and deletes of one key: where payload and index entry live in one slot (a single
Redis node) the store changes both in one transaction.  Where they cannot (a cluster,
P2PStore) :meth:`PrefixIndex.remove_then_delete` and :meth:`PrefixIndex.add_confirmed`
order and re-check the two steps so that a put racing a delete never ends as a payload
without its index entry, nor as an entry without payload (docs/design-index.md,
"Concurrent puts and deletes").
"""

from __future__ import annotations

import heapq
import itertools
import logging
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from fd_routing_replay.errors import InvalidRolloutId, TransientStoreError
from fd_routing_replay.keys import (
    MAX_KEY_BYTES,
    SEPARATORS,
    check_key,
    check_namespace,
    check_prefix,
)
from fd_routing_replay.store.index_buckets import (  # noqa: F401 - re-exported
    MAX_BUCKETS,
    BucketedLayout,
    Layout,
    bucket_of,
    rollout_base,
)

log = logging.getLogger(__name__)

DEFAULT_BATCH = 1000
"""Members per page: a ``ZRANGEBYLEX`` reads up to this many (a walk along the skiplist,
~0.1-0.3 ms of server time at any N; docs/design-index.md) and deletes go page by page."""

DEFAULT_WRITE_BATCH = 250
"""Members per ``ZADD`` / ``ZREM`` (a page's writes are cut into commands of this size,
sent in the page's one pipelined round trip).  Each member written costs a hash lookup
and a skiplist update with cache misses that grow with N: at 10M keys a 1,000-member
``ZREM`` took up to 5.7 ms; 250 members keep every command under 5 ms
(docs/benchmarks.md, "Prefix index over buckets")."""

MAX_ROUNDS = 5
"""How often a delete (or put) redoes its two steps for a key that a concurrent put (or
delete) touched in between, before it gives up with ``TransientStoreError``."""

PayloadDeleter = Callable[[list[str]], object]
"""Deletes the payloads of some keys.  Returning one bool per key (whether a payload was
there) lets :meth:`PrefixIndex.remove_then_delete` re-check only those; any other return
value means "maybe all of them"."""

PageRemover = Callable[[list[str]], int]
"""Removes one page of keys — index entries and payloads, as the store's layout allows —
and returns how many index entries it removed."""

_NEXT_BYTE = {sep.encode(): bytes([ord(sep) + 1]) for sep in SEPARATORS}  # ":"->";", "_"->"`"
_PAST_UTF8 = b"\xff"  # greater than any byte of valid UTF-8
# Anything a valid key never holds, in a page joined with "\n" (ASCII fast path).
_PAGE_SUSPECT_RE = re.compile(r"[\x00-\x09\x0b-\x20\x7f/\\]|\.\.|^\.|\n\.")
_SHOW_MEMBER = 80


def _raw(member: bytes | str) -> bytes:
    return member if isinstance(member, bytes) else member.encode("utf-8", "surrogatepass")


def split_members(members: Sequence[bytes | str]) -> tuple[list[str], list[bytes]]:
    """Split raw index members into ``(valid store keys, raw members that are not)``.

    Valid means UTF-8 and accepted by :func:`~fd_routing_replay.keys.check_key`.  A page of
    plain ASCII keys is checked with one join and one regex; anything else key by key.
    """
    raws = [_raw(m) for m in members]
    if raws and 0 < min(map(len, raws)) and max(map(len, raws)) <= MAX_KEY_BYTES:
        joined = b"\n".join(raws)
        if joined.isascii():
            text = joined.decode("ascii")
            keys = text.split("\n")  # more parts than members: a member holds "\n"
            if len(keys) == len(raws) and _PAGE_SUSPECT_RE.search(text) is None:
                return keys, []
    keys: list[str] = []
    invalid: list[bytes] = []
    for raw in raws:
        try:
            keys.append(check_key(raw.decode("utf-8")))
        except (UnicodeDecodeError, InvalidRolloutId):
            invalid.append(raw)
    return keys, invalid


def printable(name: bytes | str) -> str:
    """``name`` safe to print on one line: a valid key as it is, anything else quoted with
    every control, format and non-UTF-8 byte escaped (``'a\\nb'``, ``b'\\xff'``), and
    shortened when huge."""
    if isinstance(name, str):
        text = name
    else:
        try:
            text = name.decode("utf-8")
        except UnicodeDecodeError:
            shown = repr(name[:_SHOW_MEMBER])
            return shown if len(name) <= _SHOW_MEMBER else f"{shown}... ({len(name)} bytes)"
    try:
        return check_key(text)
    except InvalidRolloutId:
        pass
    shown = repr(text[:_SHOW_MEMBER])
    return shown if len(text) <= _SHOW_MEMBER else f"{shown}... ({len(text)} chars)"


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


class PrefixIndex(BucketedLayout):
    """All keys of one namespace, ordered, with boundary-safe prefix lookups.

    ``client`` is a redis-py ``Redis`` or ``RedisCluster`` (any ``decode_responses``).
    Keys are not validated on the way in — stores validate with ``check_key`` before
    indexing; on the way out every member is (:func:`split_members`).  Prefixes are
    validated with ``check_prefix`` (the empty prefix is rejected).  ``buckets`` is the
    configured bucket count; the layout recorded in Redis wins (read on first use).
    ``write_batch`` bounds the members of one ``ZADD``/``ZREM`` (at most ``batch``).
    """

    def __init__(self, client: Any, namespace: str, *, key_prefix: str = "rr",
                 batch: int = DEFAULT_BATCH, max_rounds: int = MAX_ROUNDS,
                 buckets: int = 1, write_batch: int = DEFAULT_WRITE_BATCH) -> None:
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        if write_batch < 1:
            raise ValueError(f"write_batch must be >= 1, got {write_batch}")
        if max_rounds < 1:
            raise ValueError(f"max_rounds must be >= 1, got {max_rounds}")
        if not 1 <= buckets <= MAX_BUCKETS:
            raise ValueError(f"buckets must be 1..{MAX_BUCKETS}, got {buckets}")
        self.client = client
        self.namespace = check_namespace(namespace)
        self.batch = batch
        self.write_batch = min(write_batch, batch)
        self.max_rounds = max_rounds
        self.key_prefix = key_prefix
        self.configured_buckets = buckets
        self.key = f"{key_prefix}:idx:{{{self.namespace}}}"
        """The single set of the one-bucket layout (the layout before buckets existed)."""
        self.meta_key = f"{key_prefix}:idxmeta:{{{self.namespace}}}"
        self._layout_cache: Layout | None = None
        self._layout_lock = threading.Lock()

    # -- writes -----------------------------------------------------------------------
    def add(self, keys: Iterable[str], pipeline: Any = None) -> None:
        """Index ``keys`` (idempotent).  With ``pipeline``, queue the commands on it instead
        of running them (the caller executes it, e.g. after the payload writes)."""
        layout = self.layout
        target = pipeline if pipeline is not None else self.client.pipeline(transaction=False)
        queued = False
        for page in _pages(keys, self.batch):
            for name, positions in self._group(page, layout, current_only=True).items():
                for chunk in _pages(positions, self.write_batch):
                    target.zadd(name, {page[p].encode("utf-8"): 0 for p in chunk})
                    queued = True
        if pipeline is None and queued:
            target.execute()

    def remove(self, keys: Iterable[str | bytes], pipeline: Any = None) -> int:
        """Drop ``keys`` (or raw members) from the index; return how many were indexed
        (0 when pipelined: the caller reads the ``ZREM`` replies)."""
        layout = self.layout
        target = pipeline if pipeline is not None else self.client.pipeline(transaction=False)
        removed = 0
        for page in _pages(keys, self.batch):
            raws = [_raw(key) for key in page]
            groups = self._group(page, layout)
            if pipeline is None and layout.old:
                # Mid-migration a key may be in two sets: count it once.
                plan = [(name, p) for name, positions in groups.items() for p in positions]
                for name, p in plan:
                    target.zrem(name, raws[p])
                gone = {p for (_, p), reply in zip(plan, target.execute(), strict=True) if reply}
                removed += len(gone)
                continue
            for name, positions in groups.items():
                for chunk in _pages(positions, self.write_batch):
                    target.zrem(name, *(raws[p] for p in chunk))
            if pipeline is None:
                removed += sum(target.execute())
        return removed

    def present(self, keys: Sequence[str]) -> list[bool]:
        """For each key, whether it is indexed (``ZMSCORE`` per bucket, one round trip)."""
        if not keys:
            return []
        pipe = self.client.pipeline(transaction=False)
        decode = self._queue_present(pipe, keys)
        return decode(pipe.execute())

    def _queue_present(self, pipe: Any, keys: Sequence[str]
                       ) -> Callable[[list[Any]], list[bool]]:
        """Queue ``ZMSCORE`` commands for ``keys`` on ``pipe``; the returned function turns
        the replies (those of these commands first) into one flag per key."""
        plan: list[list[int]] = []
        for name, positions in self._group(keys, self.layout).items():
            for page in _pages(positions, self.batch):
                pipe.zmscore(name, [keys[p].encode("utf-8") for p in page])
                plan.append(page)

        def decode(replies: list[Any]) -> list[bool]:
            found = [False] * len(keys)
            for page, scores in zip(plan, replies, strict=False):
                for position, score in zip(page, scores, strict=True):
                    if score is not None:
                        found[position] = True
            return found

        decode.commands = len(plan)  # type: ignore[attr-defined]
        return decode

    # -- both steps of a put or a delete, where they cannot share a transaction --------------
    def add_confirmed(self, key: str, write_payload: Callable[[], object],
                      payloads_exist: Callable[[list[str]], list[bool]]) -> None:
        """Put protocol for a payload that lives outside the index's slot.

        Writes the payload, indexes ``key``, then checks that the payload is still there:
        a delete that ran between the two steps removed the entry before the payload (see
        :meth:`remove_then_delete`), so the only way to lose the payload is a delete whose
        entry removal came before our ``ZADD`` — then our entry would dangle, and the put is
        redone.  Raises ``TransientStoreError`` after ``max_rounds`` such races.
        """
        max_rounds = self.max_rounds
        for _ in range(max_rounds):
            write_payload()
            self.add([key])
            if payloads_exist([key])[0]:
                return
        raise TransientStoreError(
            f"put {key!r} into {self.key}: a concurrent delete removed the record "
            f"{max_rounds} times between its write and its index entry; retry the put")

    def remove_then_delete(self, keys: Sequence[str], delete_payloads: PayloadDeleter
                           ) -> tuple[int, int]:
        """Delete protocol for payloads that live outside the index's slot.

        Removes the index entries first, then the payloads, then checks whether a put
        re-indexed any key whose payload was just deleted (its payload write came before
        our delete, its ``ZADD`` after our ``ZREM``) and redoes those keys.  Removing the
        entry first means a racing put can never be left with a payload and no entry;
        the re-check means it cannot be left with an entry and no payload either (the
        put's own re-check, :meth:`add_confirmed`, covers the other order).

        Returns ``(index entries removed by the first ZREM, keys whose payload was
        deleted)``.  A crash between the two steps leaves payloads without entries, which
        ``fd-rr fsck --repair`` indexes again (the unacknowledged delete is undone).
        Raises ``TransientStoreError`` after ``max_rounds`` rounds of races.
        """
        max_rounds = self.max_rounds
        entries = 0
        deleted: set[str] = set()
        pending = list(dict.fromkeys(keys))
        for round_number in range(max_rounds):
            if not pending:
                break
            removed = self.remove(pending)
            if round_number == 0:
                entries = removed
            flags = delete_payloads(pending)
            if isinstance(flags, list) and len(flags) == len(pending):
                gone = [key for key, flag in zip(pending, flags, strict=True) if flag]
            else:
                gone = pending
            deleted.update(gone)
            pending = [key for key, back in zip(gone, self.present(gone), strict=True) if back]
        else:
            if pending:
                raise TransientStoreError(
                    f"delete from {self.key}: {len(pending)} key(s), e.g. {pending[0]!r}, were "
                    f"indexed again by a concurrent put in each of {max_rounds} rounds; "
                    "retry the delete")
        return entries, len(deleted)

    def _remover(self, delete_payloads: PayloadDeleter | None,
                 remove_page: PageRemover | None) -> PageRemover:
        if remove_page is not None:
            if delete_payloads is not None:
                raise TypeError("pass delete_payloads or remove_page, not both")
            return remove_page
        if delete_payloads is None:
            return self.remove
        return lambda page: self.remove_then_delete(page, delete_payloads)[0]

    # -- reads ---------------------------------------------------------------------------
    def contains(self, key: str) -> bool:
        return self.present([key])[0]

    def __len__(self) -> int:
        """Every member, valid or not (``ZCARD`` of each set; mid-migration a key held by
        two sets counts twice)."""
        pipe = self.client.pipeline(transaction=False)
        for name in self.layout.read_keys:
            pipe.zcard(name)
        return int(sum(pipe.execute()))

    def count(self, prefix: str) -> int:
        """How many members ``prefix`` matches: O(B log N), whatever the match size (members
        that are not valid keys are counted too: ``ZLEXCOUNT`` cannot tell)."""
        ranges = prefix_ranges(check_prefix(prefix))
        pipe = self.client.pipeline(transaction=False)
        for name in self.layout.read_keys:
            for low, high in ranges:
                pipe.zlexcount(name, low, high)
        return int(sum(pipe.execute()))

    def match_pages(self, prefix: str, batch: int | None = None) -> Iterator[list[str]]:
        """Pages (sorted, at most ``batch`` keys each) of the keys ``prefix`` matches.

        Each page is read with ``ZRANGEBYLEX … LIMIT 0 batch`` per bucket starting after
        the previous page (the buckets' first pages in one pipelined round trip, merged),
        so removing a page's keys while iterating is safe.  Pages may be short (invalid
        members are left out) but are never empty.
        """
        for low, high in prefix_ranges(check_prefix(prefix)):
            for raw_page in self._merged_pages(low, high, batch or self.batch):
                page = self._valid(raw_page)
                if page:
                    yield page

    def match(self, prefix: str, batch: int | None = None) -> Iterator[str]:
        """The keys ``prefix`` matches, sorted, read ``batch`` at a time."""
        for page in self.match_pages(prefix, batch):
            yield from page

    def all_pages(self, batch: int | None = None) -> Iterator[list[str]]:
        """Every indexed key of the namespace, sorted, in pages (never empty)."""
        for raw_page in self.raw_pages(batch):
            page = self._valid(raw_page)
            if page:
                yield page

    def all(self, batch: int | None = None) -> Iterator[str]:
        """Every indexed key of the namespace, sorted."""
        for page in self.all_pages(batch):
            yield from page

    def raw_pages(self, batch: int | None = None) -> Iterator[list[bytes]]:
        """Every member as stored (bytes, valid or not), sorted, in pages: for ``fsck``."""
        for page in self._merged_pages(b"-", b"+", batch or self.batch):
            yield [_raw(member) for member in page]

    def sample(self, count: int) -> list[bytes | str]:
        """Up to ``count`` random members (``ZRANDMEMBER``, spread over the buckets)."""
        names = self.layout.read_keys
        share = max(1, -(-count // len(names)))
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            pipe.zrandmember(name, share)
        return [member for members in pipe.execute() for member in (members or [])][:count]

    def _merged_pages(self, low: bytes, high: bytes, batch: int) -> Iterator[list[bytes]]:
        """The members of ``[low, high]`` over every set of the layout, sorted, deduplicated
        (mid-migration a key may be in two sets), in pages of at most ``batch``."""
        names = self.layout.read_keys
        if len(names) == 1:
            for page in self._raw_range_pages(names[0], low, high, batch):
                yield [_raw(member) for member in page]
            return
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            pipe.zrangebylex(name, low, high, start=0, num=batch)
        firsts = pipe.execute()
        streams = [itertools.chain.from_iterable(self._continued(name, first, high, batch))
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

    def _continued(self, name: str, first: list[Any], high: bytes, batch: int
                   ) -> Iterator[list[bytes]]:
        first = [_raw(member) for member in first]
        yield first
        if len(first) == batch:
            for page in self._raw_range_pages(name, b"(" + first[-1], high, batch):
                yield [_raw(member) for member in page]

    def _raw_range_pages(self, name: str, low: bytes, high: bytes, batch: int
                         ) -> Iterator[list[bytes | str]]:
        while True:
            members = self.client.zrangebylex(name, low, high, start=0, num=batch)
            if not members:
                return
            yield members
            if len(members) < batch:
                return
            low = b"(" + _raw(members[-1])

    def _valid(self, members: Sequence[bytes | str]) -> list[str]:
        keys, invalid = split_members(members)
        if invalid:
            _warn_invalid(self.key, invalid)
        return keys

    # -- deletes ------------------------------------------------------------------------------
    def delete_prefix(self, prefix: str, delete_payloads: PayloadDeleter | None = None,
                      batch: int | None = None, *, remove_page: PageRemover | None = None
                      ) -> int:
        """Delete every key ``prefix`` matches (see :meth:`delete_prefixes`); return the count."""
        return self.delete_prefixes([prefix], delete_payloads, batch,
                                    remove_page=remove_page)[prefix]

    def delete_prefixes(self, prefixes: Iterable[str],
                        delete_payloads: PayloadDeleter | None = None,
                        batch: int | None = None, ranges_per_round: int = 128, *,
                        remove_page: PageRemover | None = None) -> dict[str, int]:
        """Delete every key each prefix matches, with its payload.

        Either ``remove_page(keys)`` removes a page of keys — entries and payloads — the
        way the store's layout allows (one transaction where both share a slot) and returns
        the entries it removed, or ``delete_payloads(keys)`` deletes payloads and the index
        runs :meth:`remove_then_delete` (entries first, re-checked) for each page.

        Round trips are shared: each round reads the exact-key matches of its prefixes
        with ``ZMSCORE`` (in the key's bucket) and the next page of up to
        ``ranges_per_round`` prefixes' lexicographic ranges in every bucket, all in one
        pipeline, then removes their keys page by page, so 64 small prefixes cost a few
        round trips, not 192 × B.  The counts are index entries this call removed, so two
        concurrent deletes never count a key twice (see :meth:`_remove_counted`); a key
        matched by several prefixes is counted under one of them.  Members that are not
        valid keys are skipped (with a warning).
        """
        remover = self._remover(delete_payloads, remove_page)
        size = batch or self.batch
        names = self.layout.read_keys
        checked = [check_prefix(p) for p in ([prefixes] if isinstance(prefixes, str)
                                             else prefixes)]
        counts = dict.fromkeys(checked, 0)
        exact = [p for p in counts if not p.endswith(SEPARATORS)]
        pending = [_Span.of(prefix, name) for prefix in counts for name in names]
        per_round = ranges_per_round * len(names)
        while exact or pending:
            round_exact, exact = exact[:ranges_per_round], exact[ranges_per_round:]
            round_spans, pending = pending[:per_round], pending[per_round:]
            pipe = self.client.pipeline(transaction=False)
            decode = self._queue_present(pipe, round_exact) if round_exact else None
            for span in round_spans:
                pipe.zrangebylex(span.name, span.low, span.high, start=0, num=size)
            replies = pipe.execute()
            owner: dict[str, str] = {}
            if decode is not None:
                commands = decode.commands  # type: ignore[attr-defined]
                found, replies = decode(replies[:commands]), replies[commands:]
                for prefix, here in zip(round_exact, found, strict=True):
                    if here:
                        owner.setdefault(prefix, prefix)
            for span, members in zip(round_spans, replies, strict=True):
                raw_members = [_raw(m) for m in members]
                matching = [m for m in raw_members if m.startswith(span.starts)]
                for key in self._valid(matching):
                    owner.setdefault(key, span.prefix)
                if len(raw_members) == size:  # more in this span
                    pending.append(span.after(raw_members[-1]))
            if owner:
                self._remove_counted(owner, counts, size, remover)
        return counts

    def _remove_counted(self, owner: dict[str, str], counts: dict[str, int], size: int,
                        remover: PageRemover) -> None:
        """Remove the keys of ``owner`` (key -> prefix) page by page, adding to
        ``counts[prefix]``.

        When a page's removal removes every entry (always, unless another client removed
        some of them meanwhile) the count per prefix is exact; after such a race the
        page's total is still exact and is credited to its prefixes in order.
        """
        for page in _pages(list(owner), size):
            removed = remover(page)
            for key in page[:int(removed)]:
                counts[owner[key]] += 1

    def clear(self, delete_payloads: PayloadDeleter | None = None,
              batch: int | None = None, *, remove_page: PageRemover | None = None) -> int:
        """Empty the namespace's index page by page, with the payloads when given (as in
        :meth:`delete_prefixes`).  Members that are not valid keys stay (``fsck`` drops
        them).  Returns the index entries removed."""
        remover = self._remover(delete_payloads, remove_page)
        removed = 0
        for page in self.all_pages(batch):
            removed += remover(page)
        return removed

def _warn_invalid(index_key: str, invalid: list[bytes]) -> None:
    log.warning("%s: skipped %d member(s) that are not valid store keys, e.g. %s; "
                "`fd-rr fsck` lists them and `fd-rr fsck --repair` drops them",
                index_key, len(invalid), printable(invalid[0]))


class _Span:
    """One lexicographic span a prefix delete pages through.

    For ``p`` without a trailing separator the span is ``[p:`` … ``(p``` — both separator
    ranges in one command — and its members are filtered to those starting with ``p:`` or
    ``p_``.  The keys in between (``p;`` … ``p^``, e.g. ``p@x``, ``pA``) are rare; when a
    full page ends among them, the next page jumps straight to ``[p_``, so at most one
    page per prefix is spent on them.  For ``p`` ending with a separator the span is the
    single range ``[p`` … ``(p\xff``, all of it matching.
    """

    __slots__ = ("prefix", "name", "low", "high", "starts", "gap_end")

    def __init__(self, prefix: str, name: str, low: bytes, high: bytes,
                 starts: tuple[bytes, ...], gap_end: bytes | None) -> None:
        self.prefix, self.name, self.low, self.high = prefix, name, low, high
        self.starts, self.gap_end = starts, gap_end

    @classmethod
    def of(cls, prefix: str, name: str) -> _Span:
        """The span of ``prefix`` in the index set (bucket) ``name``."""
        raw = prefix.encode("utf-8")
        if prefix.endswith(SEPARATORS):
            return cls(prefix, name, b"[" + raw, b"(" + raw + _PAST_UTF8, (raw,), None)
        colon, under = raw + b":", raw + b"_"
        return cls(prefix, name, b"[" + colon, b"(" + raw + _NEXT_BYTE[b"_"],
                   (colon, under), b"[" + under)

    def after(self, last: bytes) -> _Span:
        """The rest of the span after a full page ending with ``last``."""
        if self.gap_end is not None and not last.startswith(self.starts):
            # ``last`` lies between the ``p:`` and ``p_`` ranges: skip the rest of the gap.
            return _Span(self.prefix, self.name, self.gap_end, self.high, self.starts, None)
        return _Span(self.prefix, self.name, b"(" + last, self.high, self.starts,
                     self.gap_end)


def _pages(keys: Iterable[Any], size: int) -> Iterator[list[Any]]:
    if isinstance(keys, str | bytes):
        keys = [keys]
    page: list[Any] = []
    for key in keys:
        page.append(key)
        if len(page) == size:
            yield page
            page = []
    if page:
        yield page
