"""The prefix-bucket index: every key of a namespace in lexicographic sorted sets.

Redis keeps the index beside the data, so deleting a rollout, a trajectory or a whole
training step costs ``O(log N + matched)`` instead of listing every key (what P2PStore's
``delete_prefix_batch`` does).  Design, costs and measured memory: docs/design-index.md.

Structure: ``B`` lexicographic sorted sets per namespace (*buckets*, :mod:`.buckets`; the
count recorded in Redis, :mod:`.layout`).  The braces of each set's name are a Redis
Cluster hash tag, one per bucket, so a cluster spreads the buckets over its nodes and every
index command touches exactly one slot (no multi-slot commands, no scripts).  Exact-key
operations (put, delete, exists) touch one bucket; prefix operations read every bucket,
pipelined (bases may contain ``:``, so a rollout's prefix also matches rollouts whose base
extends it, in other buckets), and merge the sorted pages (:mod:`.ranges`).  Members are
the UTF-8 store keys, all with score 0, so ``ZRANGEBYLEX`` orders them bytewise, which for
UTF-8 is code-point order (the order of Python's ``sorted``).

Every command is bounded: ranges are read in pages of ``batch`` members with a cursor,
members are added and removed at most ``write_batch`` at a time (several commands per
page, one round trip), so no single command works on more than ``batch`` members whatever
N is, and no write on more than ``write_batch``.

Members that are not valid store keys (not UTF-8, or breaking :func:`~fd_routing_replay.keys.check_key`:
written by something else, or by hand) are never returned and never acted on: reads and
deletes skip them with a warning (:mod:`.members`), and ``fd-rr fsck`` reports them and
``--repair`` drops them.

Puts and deletes of one key: where payload and index entry live in one slot (a single
Redis node) the store changes both in one transaction.  Where they cannot (a cluster,
P2PStore) :meth:`PrefixIndex.remove_then_delete` and :meth:`PrefixIndex.add_confirmed`
order and re-check the two steps so that a put racing a delete never ends as a payload
without its index entry, nor as an entry without payload (docs/design-index.md,
"Concurrent puts and deletes").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from fd_routing_replay.errors import TransientStoreError
from fd_routing_replay.keys import SEPARATORS, check_namespace, check_prefix
from fd_routing_replay.store.index.buckets import MAX_BUCKETS
from fd_routing_replay.store.index.layout import BucketLayout, Layout
from fd_routing_replay.store.index.members import (
    pages,
    raw_member,
    split_members,
    warn_invalid_members,
)
from fd_routing_replay.store.index.ranges import Span, merged_pages, prefix_ranges

__all__ = ["DEFAULT_BATCH", "DEFAULT_WRITE_BATCH", "MAX_ROUNDS", "PageRemover", "PayloadDeleter",
           "PrefixIndex"]

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


class PrefixIndex:
    """All keys of one namespace, ordered, with boundary-safe prefix lookups.

    ``client`` is a redis-py ``Redis`` or ``RedisCluster`` (any ``decode_responses``).
    Keys are not validated on the way in — stores validate with ``check_key`` before
    indexing; on the way out every member is (:func:`split_members`).  Prefixes are
    validated with ``check_prefix`` (the empty prefix is rejected).  ``buckets`` is the
    configured bucket count; the layout recorded in Redis wins (read on first use).
    ``write_batch`` bounds the members of one ``ZADD``/``ZREM`` (at most ``batch``).
    The bucket layout is :attr:`bucket_layout` (a :class:`~.layout.BucketLayout`).
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
        self.namespace = check_namespace(namespace)
        self.batch = batch
        self.write_batch = min(write_batch, batch)
        self.max_rounds = max_rounds
        self.key_prefix = key_prefix
        self.configured_buckets = buckets
        self.bucket_layout = BucketLayout(client, self.namespace, key_prefix=key_prefix,
                                          configured=buckets)
        self.key = self.bucket_layout.key
        """The single set of the one-bucket layout (the layout before buckets existed)."""
        self.meta_key = self.bucket_layout.meta_key
        self.client = client

    @property
    def client(self) -> Any:
        """The redis-py client; setting it (tests step the client) also sets the layout's."""
        return self._client

    @client.setter
    def client(self, client: Any) -> None:
        self._client = client
        self.bucket_layout.client = client

    # -- layout (the bucket layout object does the work) -------------------------------------
    @property
    def layout(self) -> Layout:
        """The namespace's layout, read from Redis once (see :meth:`reload_layout`)."""
        return self.bucket_layout.current

    @property
    def buckets(self) -> int:
        return self.layout.buckets

    def reload_layout(self) -> Layout:
        """Forget the cached layout and read it again."""
        return self.bucket_layout.reload()

    def bucket_keys(self, buckets: int) -> tuple[str, ...]:
        """The set names of a ``buckets``-bucket layout of this namespace."""
        return self.bucket_layout.bucket_keys(buckets)

    def migrate(self, buckets: int | None = None, batch: int | None = None) -> int:
        """Move every entry into a ``buckets``-bucket layout (default: the configured
        count); return the entries moved (:meth:`BucketLayout.migrate
        <fd_routing_replay.store.index.layout.BucketLayout.migrate>`: safe to rerun after a
        crash; restart stores opened before it)."""
        return self.bucket_layout.migrate(buckets, batch=batch or self.batch,
                                          write_batch=self.write_batch)

    # -- writes -----------------------------------------------------------------------
    def add(self, keys: Iterable[str], pipeline: Any = None) -> None:
        """Index ``keys`` (idempotent).  With ``pipeline``, queue the commands on it instead
        of running them (the caller executes it, e.g. after the payload writes)."""
        layout = self.layout
        target = pipeline if pipeline is not None else self.client.pipeline(transaction=False)
        queued = False
        for page in pages(keys, self.batch):
            for name, positions in layout.group(page, current_only=True).items():
                for chunk in pages(positions, self.write_batch):
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
        for page in pages(keys, self.batch):
            raws = [raw_member(key) for key in page]
            groups = layout.group(page)
            if pipeline is None and layout.old:
                # Mid-migration a key may be in two sets: count it once.
                plan = [(name, p) for name, positions in groups.items() for p in positions]
                for name, p in plan:
                    target.zrem(name, raws[p])
                gone = {p for (_, p), reply in zip(plan, target.execute(), strict=True) if reply}
                removed += len(gone)
                continue
            for name, positions in groups.items():
                for chunk in pages(positions, self.write_batch):
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
        for name, positions in self.layout.group(keys).items():
            for page in pages(positions, self.batch):
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
            for raw_page in self._range_pages(low, high, batch):
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
        yield from self._range_pages(b"-", b"+", batch)

    def sample(self, count: int) -> list[bytes | str]:
        """Up to ``count`` random members (``ZRANDMEMBER``, spread over the buckets)."""
        names = self.layout.read_keys
        share = max(1, -(-count // len(names)))
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            pipe.zrandmember(name, share)
        return [member for members in pipe.execute() for member in (members or [])][:count]

    def _range_pages(self, low: bytes, high: bytes, batch: int | None
                     ) -> Iterator[list[bytes]]:
        """The members of ``[low, high]`` over every set of the layout, sorted, in pages."""
        return merged_pages(self.client, self.layout.read_keys, low, high, batch or self.batch)

    def _valid(self, members: Sequence[bytes | str]) -> list[str]:
        keys, invalid = split_members(members)
        if invalid:
            warn_invalid_members(self.key, invalid)
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
        pending = [Span.of(prefix, name) for prefix in counts for name in names]
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
                raw_members = [raw_member(m) for m in members]
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
        for page in pages(list(owner), size):
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
