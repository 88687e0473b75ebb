"""``retention.ttl_s`` applied by Redis itself: a per-record expiry set at write time, and
the index entries it leaves behind cleaned up where fsck can tell them from corruption.

A put of an rr-v1 record whose header says ``created`` sets ``PEXPIREAT`` on the
record's one HASH (every chunk is a field of it, so all its bytes expire together) at
``created + ttl_s``, in the same ``MULTI`` as the write, so rewriting a key (a newer
turn) replaces the expiry with the new record's.  A record never expires before it is
``ttl_s`` old, whatever the writer's clock says about "now"; one that is already past
it when written is not stored (as if it had expired at once).  Values without a
``created`` (FastDeploy's raw formats, foreign bytes) get no expiry, as the sweeper
never deletes them by age either.

Redis drops an expired payload but not its index entry.  So each expiring put also
records ``key -> expiry time (ms)`` in ``{key_prefix}:exp:{namespace}``, a sorted set
scored by time (one per namespace, beside the single-set index; on a cluster it lives
on one node, ~60 B per record).  That set tells an *expired* entry (payload gone, its
recorded expiry passed) from a *dangling* one (payload lost otherwise):

* :meth:`RecordExpiry.purge` — the sweeper's pass: ``ZRANGEBYSCORE`` of what is due,
  then, page by page, drop the index and expiry entries of those whose payload is gone
  (re-checked afterwards: a put that raced the removal gets its entries back) and
  re-sync the expiry entries of payloads that were rewritten without one;
* :meth:`RecordExpiry.expired` — which of some dangling-looking keys are expired entries
  (``fd-rr fsck`` reports those apart and ``--repair`` purges them);
* :meth:`RecordExpiry.due_mask` — ``list`` leaves out entries already due.

Deletes remove the expiry entries with the index entries.  On a cluster a put without
a TTL leaves an older expiry entry of the key in place (a purge re-syncs it); on one node
the put's ``MULTI`` removes it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from fd_routing_replay.codec import MAGIC, PREFIX_BYTES, header_region_length, read_header
from fd_routing_replay.errors import RecordError
from fd_routing_replay.store.base import Buffer
from fd_routing_replay.store.index.members import split_members

__all__ = ["RecordExpiry", "record_created"]


def record_created(parts: Sequence[Buffer]) -> float | None:
    """``created`` from the rr-v1 header at the start of ``parts``, or None (not rr-v1,
    unreadable header, or no ``created``)."""
    head = b""
    wanted = PREFIX_BYTES
    for part in parts:
        head += bytes(memoryview(part).cast("B")[:wanted - len(head)])
        if len(head) >= PREFIX_BYTES and wanted == PREFIX_BYTES:
            if head[:len(MAGIC)] != MAGIC:
                return None
            try:
                wanted = header_region_length(head)  # header (and its checksum, version 2)
            except RecordError:
                return None
            if len(head) < wanted:
                head += bytes(memoryview(part).cast("B")[len(head):wanted])
        if len(head) >= wanted:
            break
    try:
        created = read_header(head, require_payload=False).created
    except RecordError:
        return None
    return float(created) if isinstance(created, int | float) else None


class RecordExpiry:
    """The expiry side of one redis store's namespace (see the module docstring).

    ``pkey`` maps a store key to its payload's Redis key; ``index`` is the store's
    :class:`~fd_routing_replay.store.index.prefix_index.PrefixIndex`.  ``ttl_s`` 0 means
    puts set no expiry (deletes, purges and fsck still honour expiry entries other writers
    made).
    """

    def __init__(self, client: Any, namespace: str, key_prefix: str, index: Any,
                 pkey: Callable[[str], str], *, batch: int = 1000) -> None:
        self.client = client
        self.index = index
        self.pkey = pkey
        self.batch = batch
        self.key = f"{key_prefix}:exp:{{{namespace}}}"
        self.ttl_s = 0.0
        self.clock: Callable[[], float] = time.time

    # -- puts ------------------------------------------------------------------------------
    def expire_at_ms(self, parts: Sequence[Buffer]) -> int | None:
        """When a record put now should expire (unix ms), or None for no expiry."""
        if self.ttl_s <= 0:
            return None
        created = record_created(parts)
        return None if created is None else round((created + self.ttl_s) * 1000)

    def is_past(self, at_ms: int) -> bool:
        return at_ms <= self.clock() * 1000

    def queue_put(self, pipe: Any, key: str, at_ms: int | None) -> None:
        """Queue, after the payload's ``HSET``, its expiry and expiry entry (or, without
        one, the removal of an older expiry entry of the key)."""
        if at_ms is None:
            pipe.zrem(self.key, key.encode("utf-8"))
        else:
            pipe.pexpireat(self.pkey(key), at_ms)
            pipe.zadd(self.key, {key.encode("utf-8"): at_ms})

    def queue_forget(self, pipe: Any, keys: Sequence[str]) -> int:
        """Queue the removal of the expiry entries of ``keys`` (deletes); return how many
        commands were queued."""
        size = self.index.write_batch
        for start in range(0, len(keys), size):
            pipe.zrem(self.key, *(key.encode("utf-8") for key in keys[start:start + size]))
        return -(-len(keys) // size)

    # -- reads -------------------------------------------------------------------------------
    def due_mask(self, keys: Sequence[str]) -> list[bool] | None:
        """Per key, whether its recorded expiry has passed; None when the namespace has no
        expiry entries at all (one ``EXISTS``, so stores without a TTL pay one command)."""
        if not keys or not self.client.exists(self.key):
            return None
        now_ms = self.clock() * 1000
        due: list[bool] = []
        for start in range(0, len(keys), self.batch):
            page = keys[start:start + self.batch]
            scores = self.client.zmscore(self.key, [key.encode("utf-8") for key in page])
            due += [score is not None and score <= now_ms for score in scores]
        return due

    def expired(self, keys: Sequence[str]) -> list[str]:
        """Those of ``keys`` whose recorded expiry has passed (for keys whose payload is
        gone: expired entries, not lost records)."""
        mask = self.due_mask(list(keys))
        return [] if mask is None else [key for key, due in zip(keys, mask, strict=True) if due]

    # -- cleanup ---------------------------------------------------------------------------
    def purge(self, keys: Sequence[str] | None = None) -> int:
        """Drop the index and expiry entries of expired records; return how many records'
        entries were dropped.  ``keys``: only those (fsck's repair); default: every expiry
        entry that is due, page by page."""
        purged = 0
        seen: set[str] = set()
        pages = None if keys is None else [list(keys[start:start + self.batch])
                                           for start in range(0, len(keys), self.batch)]
        while True:
            if pages is not None:
                if not pages:
                    break
                page = pages.pop()
            else:
                raw = self.client.zrangebyscore(self.key, "-inf", int(self.clock() * 1000),
                                                start=0, num=self.batch)
                valid, invalid = split_members(raw)
                if invalid:  # not ours to interpret: drop them from the expiry set
                    self.client.zrem(self.key, *invalid)
                page = [key for key in valid if key not in seen]
                if not page:
                    break
            seen.update(page)
            purged += self._purge_page(page)
        return purged

    def _purge_page(self, keys: list[str]) -> int:
        exists = self.payloads_exist(keys)
        gone = [key for key, found in zip(keys, exists, strict=True) if not found]
        kept = [key for key, found in zip(keys, exists, strict=True) if found]
        if gone:
            pipe = self.client.pipeline(transaction=False)
            self.index.remove(gone, pipeline=pipe)
            self.queue_forget(pipe, gone)
            pipe.execute()
            # A put that landed meanwhile: give it back its entries (its own, current ones).
            back = [key for key, found in zip(gone, self.payloads_exist(gone), strict=True)
                    if found]
            self._resync(back, reindex=True)
            gone = [key for key in gone if key not in set(back)]
        self._resync(kept, reindex=False)
        return len(gone)

    def _resync(self, keys: list[str], *, reindex: bool) -> None:
        """Set the expiry entries of existing payloads to their actual expiry (removed for
        a payload without one); ``reindex`` also restores their index entries."""
        if not keys:
            return
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.pexpiretime(self.pkey(key))
        times = pipe.execute()
        pipe = self.client.pipeline(transaction=False)
        if reindex:
            self.index.add(keys, pipeline=pipe)
        for key, at_ms in zip(keys, times, strict=True):
            if at_ms is not None and int(at_ms) > 0:
                pipe.zadd(self.key, {key.encode("utf-8"): int(at_ms)})
            elif at_ms is not None and int(at_ms) == -1:
                pipe.zrem(self.key, key.encode("utf-8"))
        pipe.execute()

    def payloads_exist(self, keys: Sequence[str]) -> list[bool]:
        """For each key, whether its payload exists (one pipelined round trip)."""
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(self.pkey(key))
        return [bool(found) for found in pipe.execute()]
