"""The bucket layout of a namespace's prefix index: how many sorted sets hold it, as
recorded in Redis, and migration from one bucket count to another.

``B = 1`` (the default): the one set ``{key_prefix}:idx:{ns}`` (the layout from before
buckets existed).  ``B > 1``: the sets ``{key_prefix}:idx:{ns#i.salt}`` (:mod:`.buckets`).
``{key_prefix}:idxmeta:{ns}`` (a HASH, absent for one set) records ``buckets`` and the
``old`` bucket counts that still hold entries during a migration; the recorded layout wins
over the configured count, and while old layouts hold entries they are read too.

:class:`Layout` is one immutable snapshot (which sets hold which keys);
:class:`BucketLayout` reads, caches and rewrites the record for one
:class:`~fd_routing_replay.store.index.prefix_index.PrefixIndex`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

from fd_routing_replay.errors import PermanentStoreError
from fd_routing_replay.store.index.buckets import MAX_BUCKETS, bucket_of, spread_tags
from fd_routing_replay.store.index.members import pages, raw_member, split_members

__all__ = ["BucketLayout", "Layout"]

log = logging.getLogger("fd_routing_replay.store.index")


class Layout(NamedTuple):
    """Where a namespace's entries live: the current buckets, plus older layouts (bucket
    counts) that still hold entries during a migration."""

    buckets: int
    keys: tuple[str, ...]           # the current buckets' set names
    old: tuple[int, ...]            # older bucket counts, read and cleaned until migrated
    old_keys: tuple[tuple[str, ...], ...]

    @property
    def read_keys(self) -> tuple[str, ...]:
        """Every set a read must look at: the current buckets, then the old ones."""
        return self.keys + tuple(k for keys in self.old_keys for k in keys)

    def homes(self, key: str) -> list[str]:
        """The sets that may hold ``key``: its bucket, and its bucket in every old layout."""
        homes = [self.keys[bucket_of(key, self.buckets)]]
        for count, keys in zip(self.old, self.old_keys, strict=True):
            homes.append(keys[bucket_of(key, count)])
        return homes

    def group(self, keys: Sequence[str | bytes], *, current_only: bool = False
              ) -> dict[str, list[int]]:
        """Positions of ``keys`` grouped by the set that may hold them (a raw member, bytes
        from fsck, may be in any set); ``current_only``: only the current bucket."""
        groups: dict[str, list[int]] = {}
        if len(self.keys) == 1 and not self.old:
            groups[self.keys[0]] = list(range(len(keys)))
            return groups
        for position, key in enumerate(keys):
            if isinstance(key, bytes):  # a raw member (fsck): written anywhere, by anyone
                for name in self.read_keys:
                    groups.setdefault(name, []).append(position)
                continue
            homes = self.homes(key)
            for name in homes[:1] if current_only else homes:
                groups.setdefault(name, []).append(position)
        return groups


class BucketLayout:
    """The recorded bucket layout of one namespace's index (see the module docstring).

    ``client`` is a redis-py client; ``configured`` the configured bucket count, recorded
    on first use when no layout is recorded yet.  :attr:`current` is read from Redis once
    and cached (thread-safe); :meth:`reload` reads it again.
    """

    def __init__(self, client: Any, namespace: str, *, key_prefix: str, configured: int) -> None:
        self.client = client
        self.namespace = namespace
        self.key_prefix = key_prefix
        self.configured = configured
        self.key = f"{key_prefix}:idx:{{{namespace}}}"
        """The single set of the one-bucket layout (the layout before buckets existed)."""
        self.meta_key = f"{key_prefix}:idxmeta:{{{namespace}}}"
        self._cache: Layout | None = None
        self._lock = threading.Lock()

    def bucket_keys(self, buckets: int) -> tuple[str, ...]:
        """The set names of a ``buckets``-bucket layout of this namespace."""
        if buckets == 1:
            return (self.key,)
        return tuple(f"{self.key_prefix}:idx:{{{tag}}}"
                     for tag in spread_tags(self.namespace, buckets))

    @property
    def current(self) -> Layout:
        """The namespace's layout, read from Redis once (see :meth:`reload`)."""
        layout = self._cache
        if layout is None:
            with self._lock:
                if self._cache is None:
                    self._cache = self._load()
                layout = self._cache
        return layout

    def reload(self) -> Layout:
        """Forget the cached layout and read it again."""
        with self._lock:
            self._cache = self._load()
            return self._cache

    def _load(self) -> Layout:
        meta = self._read_meta()
        if meta is None and self.configured > 1:
            # First use with buckets: record them; a single-set index with entries becomes
            # an old layout, read until `fd-rr fsck --migrate-index` moves its entries.
            old = (1,) if self.client.exists(self.key) else ()
            self.client.hsetnx(self.meta_key, "buckets", self.configured)
            if old:
                self.client.hsetnx(self.meta_key, "old", "1")
                log.warning("%s: the prefix index of namespace %r is a single set; new entries go "
                            "to %d buckets and both are read until `fd-rr fsck --migrate-index` "
                            "moves the old entries", self.key, self.namespace, self.configured)
            meta = self._read_meta()
        buckets, old = meta if meta is not None else (1, ())
        if buckets != self.configured:
            # Configured 1 is the default (not a choice worth a warning): say it quietly.
            (log.info if self.configured == 1 else log.warning)(
                "%s: namespace %r's index has %d bucket(s) (recorded in %s), not the "
                "configured %d; using %d (`fd-rr fsck --migrate-index` re-buckets it)",
                self.key, self.namespace, buckets, self.meta_key, self.configured, buckets)
        return Layout(buckets, self.bucket_keys(buckets), old,
                      tuple(self.bucket_keys(count) for count in old))

    def _read_meta(self) -> tuple[int, tuple[int, ...]] | None:
        raw = self.client.hgetall(self.meta_key)
        if not raw:
            return None
        fields = {_text(name): _text(value) for name, value in raw.items()}
        try:
            buckets = int(fields.get("buckets", "1"))
            old = tuple(int(part) for part in fields.get("old", "").split(",") if part)
        except ValueError:
            raise PermanentStoreError(f"{self.meta_key} is malformed ({fields}); expected "
                                      "buckets=<n> and old=<n,...>") from None
        if not 1 <= buckets <= MAX_BUCKETS or any(not 1 <= c <= MAX_BUCKETS for c in old):
            raise PermanentStoreError(f"{self.meta_key} names bucket counts out of 1.."
                                      f"{MAX_BUCKETS}: {fields}")
        return buckets, old

    def _write_meta(self, buckets: int, old: Sequence[int]) -> None:
        if buckets == 1 and not old:
            self.client.delete(self.meta_key)  # the one-set layout needs no record
            return
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(self.meta_key, mapping={"buckets": buckets,
                                          "old": ",".join(str(count) for count in old)})
        pipe.execute()

    # -- migration between bucket counts ----------------------------------------------------
    def migrate(self, buckets: int | None, *, batch: int, write_batch: int) -> int:
        """Move every entry into a ``buckets``-bucket layout (default: the configured
        count), reading ``batch`` members and writing ``write_batch`` per command; return
        the entries moved.

        The target layout is recorded first (with the current one as an *old* layout), so
        a store opened from then on writes to the new buckets and reads both; the old sets
        are then emptied page by page (``ZADD`` to the new bucket, then ``ZREM`` from the
        old set: a crash leaves an entry in both, which reads merge and a rerun finishes),
        and the old layout is forgotten once empty.  Stores opened before the migration
        keep the layout they read: restart them afterwards.
        """
        target = self.configured if buckets is None else buckets
        if not 1 <= target <= MAX_BUCKETS:
            raise ValueError(f"buckets must be 1..{MAX_BUCKETS}, got {target}")
        layout = self.reload()
        old = [count for count in (layout.buckets, *layout.old) if count != target]
        old = list(dict.fromkeys(old))
        self._write_meta(target, old)
        layout = self.reload()
        moved = 0
        for count in old:
            for name in self.bucket_keys(count):
                while True:
                    members = self.client.zrangebylex(name, b"-", b"+", start=0, num=batch)
                    if not members:
                        break
                    moved += self._move_page(name, [raw_member(m) for m in members], layout,
                                             write_batch)
        self._write_meta(target, [])
        self.reload()
        return moved

    def _move_page(self, name: str, raws: list[bytes], layout: Layout, write_batch: int) -> int:
        """Move one page of members of the old set ``name`` into ``layout``'s buckets."""
        keys, invalid = split_members(raws)
        pipe = self.client.pipeline(transaction=False)
        for bucket, positions in layout.group(keys, current_only=True).items():
            for chunk in pages(positions, write_batch):
                pipe.zadd(bucket, {keys[p].encode("utf-8"): 0 for p in chunk})
        if invalid:  # kept (in bucket 0) for fsck to report and drop
            pipe.zadd(layout.keys[0], dict.fromkeys(invalid, 0))
        pipe.execute()
        pipe = self.client.pipeline(transaction=False)
        for chunk in pages(raws, write_batch):
            pipe.zrem(name, *chunk)
        pipe.execute()
        return len(raws)


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
