"""Buckets of the prefix index: which sorted set holds a key, the layout recorded in Redis,
and migration between bucket counts (used by :class:`~fd_routing_replay.store.index.PrefixIndex`).

A namespace's index is ``B`` sorted sets.  ``B = 1``: ``{key_prefix}:idx:{ns}`` (the layout
from before buckets existed).  ``B > 1``: ``{key_prefix}:idx:{ns#i.salt}``, one Redis Cluster
hash tag per bucket, the salt chosen so the buckets' slots spread evenly
(:func:`spread_tags`).  A key's bucket is a CRC32 of its rollout base, so every turn,
segment and layer of a rollout shares a bucket.  ``{key_prefix}:idxmeta:{ns}`` (a HASH,
absent for one set) records ``buckets`` and the ``old`` bucket counts that still hold
entries during a migration; the recorded layout wins over the configured count.
"""

from __future__ import annotations

import functools
import itertools
import logging
import re
import threading
import zlib
from collections.abc import Sequence
from typing import Any, NamedTuple

from fd_routing_replay.errors import PermanentStoreError

log = logging.getLogger("fd_routing_replay.store.index")

MAX_BUCKETS = 256
"""Upper bound of ``store.redis.index_buckets`` (a prefix read costs one command per bucket)."""

_BASE_RE = re.compile(r"(.+):(?:0|[1-9][0-9]*):(?:0|[1-9][0-9]*)(?:_[0-9]+)?", re.DOTALL)


def rollout_base(key: str) -> str:
    """The rollout base of a store key (``{base}:{turn}:{segment}`` with an optional
    ``_{layer}``), or the key itself when it has no such shape."""
    match = _BASE_RE.fullmatch(key)
    return match.group(1) if match else key


def bucket_of(key: str, buckets: int) -> int:
    """The bucket (0 .. buckets-1) holding ``key``: CRC32 of its rollout base."""
    if buckets == 1:
        return 0
    return zlib.crc32(rollout_base(key).encode("utf-8", "surrogatepass")) % buckets


CLUSTER_SLOTS = 16384


@functools.lru_cache(maxsize=256)
def spread_tags(namespace: str, buckets: int) -> tuple[str, ...]:
    """Hash tags ``{ns}#{i}.{salt}`` for buckets 0 .. buckets-1: bucket i takes the first salt
    whose cluster slot lies in the i-th of ``buckets`` equal slot ranges, so the buckets
    spread over a cluster's nodes as evenly as its slot assignment allows (a cluster
    created with ``redis-cli --cluster create`` gives each master one contiguous range).
    Deterministic: every process computes the same names."""
    from redis.crc import key_slot

    tags = []
    for number in range(buckets):
        for salt in itertools.count():
            tag = f"{namespace}#{number}.{salt}"
            if key_slot(tag.encode()) * buckets // CLUSTER_SLOTS == number:
                tags.append(tag)
                break
    return tuple(tags)


class Layout(NamedTuple):
    """Where a namespace's entries live: the current buckets, plus older layouts (bucket
    counts) that still hold entries during a migration."""

    buckets: int
    keys: tuple[str, ...]           # the current buckets' set names
    old: tuple[int, ...]            # older bucket counts, read and cleaned until migrated
    old_keys: tuple[tuple[str, ...], ...]

    @property
    def read_keys(self) -> tuple[str, ...]:
        return self.keys + tuple(k for keys in self.old_keys for k in keys)



class BucketedLayout:
    """The bucket half of :class:`~fd_routing_replay.store.index.PrefixIndex`: needs
    ``client``, ``namespace``, ``key``, ``meta_key``, ``key_prefix``, ``batch``,
    ``write_batch``, ``configured_buckets``, ``_layout_cache`` and ``_layout_lock``."""

    client: Any
    namespace: str
    key: str
    meta_key: str
    key_prefix: str
    batch: int
    write_batch: int
    configured_buckets: int
    _layout_cache: Layout | None
    _layout_lock: threading.Lock

    # -- layout --------------------------------------------------------------------------------
    def bucket_keys(self, buckets: int) -> tuple[str, ...]:
        """The set names of a ``buckets``-bucket layout of this namespace."""
        if buckets == 1:
            return (self.key,)
        return tuple(f"{self.key_prefix}:idx:{{{tag}}}"
                     for tag in spread_tags(self.namespace, buckets))

    @property
    def layout(self) -> Layout:
        """The namespace's layout, read from Redis once (see :meth:`reload_layout`)."""
        layout = self._layout_cache
        if layout is None:
            with self._layout_lock:
                if self._layout_cache is None:
                    self._layout_cache = self._load_layout()
                layout = self._layout_cache
        return layout

    @property
    def buckets(self) -> int:
        return self.layout.buckets

    def reload_layout(self) -> Layout:
        """Forget the cached layout and read it again."""
        with self._layout_lock:
            self._layout_cache = self._load_layout()
            return self._layout_cache

    def _load_layout(self) -> Layout:
        meta = self._read_meta()
        if meta is None and self.configured_buckets > 1:
            # First use with buckets: record them; a single-set index with entries becomes
            # an old layout, read until `fd-rr fsck --migrate-index` moves its entries.
            old = (1,) if self.client.exists(self.key) else ()
            self.client.hsetnx(self.meta_key, "buckets", self.configured_buckets)
            if old:
                self.client.hsetnx(self.meta_key, "old", "1")
                log.warning("%s: the prefix index of namespace %r is a single set; new entries go "
                            "to %d buckets and both are read until `fd-rr fsck --migrate-index` "
                            "moves the old entries", self.key, self.namespace,
                            self.configured_buckets)
            meta = self._read_meta()
        buckets, old = meta if meta is not None else (1, ())
        if buckets != self.configured_buckets:
            # Configured 1 is the default (not a choice worth a warning): say it quietly.
            (log.info if self.configured_buckets == 1 else log.warning)("%s: namespace %r's index has %d bucket(s) (recorded in %s), not the "
                        "configured %d; using %d (`fd-rr fsck --migrate-index` re-buckets it)",
                        self.key, self.namespace, buckets, self.meta_key,
                        self.configured_buckets, buckets)
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

    def _home(self, key: str, layout: Layout) -> list[str]:
        """The sets that may hold ``key``: its bucket, and its bucket in every old layout."""
        homes = [layout.keys[bucket_of(key, layout.buckets)]]
        for count, keys in zip(layout.old, layout.old_keys, strict=True):
            homes.append(keys[bucket_of(key, count)])
        return homes

    def _group(self, keys: Sequence[str | bytes], layout: Layout, *, current_only: bool = False
               ) -> dict[str, list[int]]:
        """Positions of ``keys`` grouped by the set that may hold them (a raw member, bytes
        from fsck, may be in any set)."""
        groups: dict[str, list[int]] = {}
        if len(layout.keys) == 1 and not layout.old:
            groups[layout.keys[0]] = list(range(len(keys)))
            return groups
        for position, key in enumerate(keys):
            if isinstance(key, bytes):  # a raw member (fsck): written anywhere, by anyone
                for name in layout.read_keys:
                    groups.setdefault(name, []).append(position)
                continue
            homes = self._home(key, layout)
            for name in homes[:1] if current_only else homes:
                groups.setdefault(name, []).append(position)
        return groups

    # -- migration between bucket counts ----------------------------------------------------
    def migrate(self, buckets: int | None = None, batch: int | None = None) -> int:
        """Move every entry into a ``buckets``-bucket layout (default: the configured
        count); return the entries moved.

        The target layout is recorded first (with the current one as an *old* layout), so
        a store opened from then on writes to the new buckets and reads both; the old sets
        are then emptied page by page (``ZADD`` to the new bucket, then ``ZREM`` from the
        old set: a crash leaves an entry in both, which reads merge and a rerun finishes),
        and the old layout is forgotten once empty.  Stores opened before the migration
        keep the layout they read: restart them afterwards.
        """
        from fd_routing_replay.store.index import split_members

        target = self.configured_buckets if buckets is None else buckets
        if not 1 <= target <= MAX_BUCKETS:
            raise ValueError(f"buckets must be 1..{MAX_BUCKETS}, got {target}")
        size = batch or self.batch
        layout = self.reload_layout()
        old = [count for count in (layout.buckets, *layout.old) if count != target]
        old = list(dict.fromkeys(old))
        self._write_meta(target, old)
        layout = self.reload_layout()
        moved = 0
        for count in old:
            for name in self.bucket_keys(count):
                while True:
                    members = self.client.zrangebylex(name, b"-", b"+", start=0, num=size)
                    if not members:
                        break
                    raws = [_raw(m) for m in members]
                    keys, invalid = split_members(raws)
                    pipe = self.client.pipeline(transaction=False)
                    for bucket, positions in self._group(keys, layout, current_only=True
                                                         ).items():
                        for chunk in _chunks(positions, self.write_batch):
                            pipe.zadd(bucket, {keys[p].encode("utf-8"): 0 for p in chunk})
                    if invalid:  # kept (in bucket 0) for fsck to report and drop
                        pipe.zadd(layout.keys[0], dict.fromkeys(invalid, 0))
                    pipe.execute()
                    pipe = self.client.pipeline(transaction=False)
                    for chunk in _chunks(raws, self.write_batch):
                        pipe.zrem(name, *chunk)
                    pipe.execute()
                    moved += len(raws)
        self._write_meta(target, [])
        self.reload_layout()
        return moved

    def _write_meta(self, buckets: int, old: Sequence[int]) -> None:
        if buckets == 1 and not old:
            self.client.delete(self.meta_key)  # the one-set layout needs no record
            return
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(self.meta_key, mapping={"buckets": buckets,
                                          "old": ",".join(str(count) for count in old)})
        pipe.execute()



def _chunks(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    return [items[start:start + size] for start in range(0, len(items), size)]


def _raw(member: bytes | str) -> bytes:
    return member if isinstance(member, bytes) else member.encode("utf-8", "surrogatepass")


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)

