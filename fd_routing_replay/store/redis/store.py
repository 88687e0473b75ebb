"""Records stored in Redis itself (single node, TLS, ACL, or Redis Cluster).

Layout, per namespace ``ns`` (``rr`` is the key prefix):

* ``rr:{ns/KEY}`` — one HASH per record: fields ``n`` (chunk count), ``s`` (total size)
  and ``0`` … ``n-1``, the record cut into chunks of at most ``chunk_bytes``.  One key per
  record means an overwrite is one single-slot ``MULTI``/``EXEC`` (``UNLINK`` + ``HSET``)
  and a reader's ``HGETALL`` sees either the old or the new record, never a mix; the
  chunks share the record's hash tag by construction.  ``UNLINK`` frees big records in
  Redis's background thread.
* ``rr:idx:{ns}`` — the prefix-bucket index (:mod:`fd_routing_replay.store.index`); with
  ``store.redis.index_buckets: B > 1``, ``B`` sets ``rr:idx:{ns#i.salt}`` (one hash tag each, so a
  cluster spreads them) and ``rr:idxmeta:{ns}`` recording ``B``.

Puts and deletes.  On a single node the payload and its index entry change together: a
put is one ``MULTI``/``EXEC`` (``UNLINK`` + ``HSET`` + ``ZADD``) and a delete one per page
(``UNLINK`` of the payloads + ``ZREM`` of their entries), so they are atomic with respect to
each other and to a crash.  On a cluster they live in different slots, so no transaction
covers both: a put writes the payload, indexes it and checks the payload is still there
(:meth:`PrefixIndex.add_confirmed`); a delete removes the entries first, then the payloads,
and redoes keys a racing put re-indexed (:meth:`PrefixIndex.remove_then_delete`).  A racing
put and delete therefore always end with both or neither; a crash between the two steps
leaves an unindexed payload, which ``fd-rr fsck --repair`` indexes
(:mod:`fd_routing_replay.store.index.fsck`, docs/design-index.md).

Errors: connection failures and timeouts (server down, restarting, loading, cluster
resharding) raise ``TransientStoreError``; bad credentials, missing permissions and
everything else raise ``PermanentStoreError``.  redis-py reconnects by itself, so a store
keeps working after Redis comes back without being reopened.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from fd_routing_replay.errors import TransientStoreError
from fd_routing_replay.keys import check_key
from fd_routing_replay.store.base import Buffer
from fd_routing_replay.store.index.members import printable
from fd_routing_replay.store.index.prefix_index import PrefixIndex
from fd_routing_replay.store.indexed import IndexedStore
from fd_routing_replay.store.redis.expiry import RecordExpiry
from fd_routing_replay.store.redis.ranges import (
    BytesRangeView,
    RecordRangeView,
    open_record_ranges,
)
from fd_routing_replay.store.redis.records import (
    COUNT_FIELD,
    DEFAULT_CHUNK_BYTES,
    KEY_PREFIX,
    SIZE_FIELD,
    assemble,
    cut_chunks,
    decimal,
    payload_key,
    record_problems,
)
from fd_routing_replay.store.redis_client import translate_error

__all__ = ["RedisStore"]

_GET_MANY_BATCH = 256
_DELETE_BYTES = 16 * 2**20  # records freed per delete transaction (one at least): _slices
_PAGE = 1000  # keys per pipelined payload batch
_QUARANTINE_TRIES = 100  # rr:quarantine:<time>:<name>, then …#2 … #100
_OTHER_SLOT = ("CROSSSLOT", "same key slot")  # Redis's and redis-py's cluster refusals


class RedisStore(IndexedStore):
    """Routing records in Redis with the prefix-bucket index beside them.

    ``client`` is a redis-py ``Redis`` or ``RedisCluster`` with ``decode_responses=False``;
    use :func:`~fd_routing_replay.store.redis.factory.open_redis_store` to build one
    from a config.  Thread-safe.
    """

    scheme = "redis"

    def __init__(self, client: Any, namespace: str, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 cluster: bool = False, location: str = "redis", key_prefix: str = KEY_PREFIX,
                 batch: int = _PAGE, index_buckets: int = 1) -> None:
        super().__init__(namespace)
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self.client = client
        self.cluster = cluster
        self.chunk_bytes = chunk_bytes
        self.location = location
        self.key_prefix = key_prefix
        self.batch = batch
        self.delete_batch = batch
        self.delete_bytes = _DELETE_BYTES
        self.index = PrefixIndex(client, self.namespace, key_prefix=key_prefix, batch=batch,
                                 buckets=index_buckets)
        self.expiry = RecordExpiry(client, self.namespace, key_prefix, self.index,
                                   self.pkey, batch=batch)
        self._closed = False
        self._close_lock = threading.Lock()
        self._scan_prefix = f"{key_prefix}:{{{self.namespace}/"

    # -- helpers ------------------------------------------------------------------------
    def pkey(self, key: str) -> str:
        """The Redis key of ``key``'s record HASH (:func:`~.records.payload_key`)."""
        return payload_key(self.namespace, key, self.key_prefix)

    # -- writes -----------------------------------------------------------------------------
    def put(self, key: str, value: Buffer) -> None:
        self.put_parts(key, [value])

    def put_parts(self, key: str, parts: Sequence[Buffer]) -> None:
        """Store the concatenation of ``parts`` chunk by chunk (no full join client-side)."""
        key = check_key(key)
        mapping: dict[bytes, Any] = {}
        size = 0
        for number, chunk in enumerate(cut_chunks(list(parts), self.chunk_bytes)):
            mapping[str(number).encode()] = chunk
            size += memoryview(chunk).nbytes
        mapping[COUNT_FIELD] = len(mapping)
        mapping[SIZE_FIELD] = size
        pkey = self.pkey(key)
        expire_at_ms = self.expiry.expire_at_ms(parts)  # retention.ttl_s, set by the writer
        if expire_at_ms is not None and self.expiry.is_past(expire_at_ms):
            self.delete([key])  # older than its TTL already: as if it expired at once
            return
        with self.translate_errors(f"put {key!r}"):
            if self.cluster:  # the index lives in another slot: payload, index, re-check
                def write_payload() -> None:
                    pipe = self.client.pipeline(transaction=True)
                    pipe.unlink(pkey)
                    pipe.hset(pkey, mapping=mapping)
                    if expire_at_ms is not None:
                        pipe.pexpireat(pkey, expire_at_ms)
                    pipe.execute()

                def payload_stayed(keys: list[str]) -> list[bool]:
                    # gone because it expired meanwhile (not a racing delete): done
                    return [found or (expire_at_ms is not None
                                      and self.expiry.is_past(expire_at_ms))
                            for found in self.payloads_exist(keys)]

                if expire_at_ms is not None:  # first: a crash leaves only a purgeable entry
                    self.client.zadd(self.expiry.key, {key.encode("utf-8"): expire_at_ms})
                self.index.add_confirmed(key, write_payload, payload_stayed)
            else:  # one node: payload, expiry and index entry in one transaction
                pipe = self.client.pipeline(transaction=True)
                pipe.unlink(pkey)
                pipe.hset(pkey, mapping=mapping)
                self.expiry.queue_put(pipe, key, expire_at_ms)
                self.index.add([key], pipeline=pipe)
                pipe.execute()

    def _remove_keys(self, keys: list[str]) -> tuple[int, int]:
        """Remove one page of keys, entries and payloads: ``(entries, payloads)`` removed.

        One node: one ``MULTI``/``EXEC`` (multi-key ``UNLINK`` + ``ZREM``) per slice of the
        page (:meth:`_slices`), so a concurrent put of one of these keys lands wholly before
        or wholly after it.  Cluster: entries first, then payloads, re-checked
        (:meth:`PrefixIndex.remove_then_delete`).
        """
        if self.cluster:
            return self.index.remove_then_delete(keys, self.unlink_payloads)
        entries = payloads = 0
        for part in self._slices(keys):
            pipe = self.client.pipeline(transaction=True)
            pipe.unlink(*(self.pkey(key) for key in part))
            forgets = self.expiry.queue_forget(pipe, part)
            self.index.remove(part, pipeline=pipe)
            unlinked, *replies = pipe.execute()
            entries += int(sum(replies[forgets:]))
            payloads += int(unlinked)
        return entries, payloads

    def unlink_payloads(self, keys: list[str]) -> list[bool]:
        """UNLINK each key's payload (pipelined, one round trip per slice of
        :meth:`_slices`; per node on a cluster); return whether each existed.  Leaves the
        index alone."""
        found: list[bool] = []
        for part in self._slices(keys):
            pipe = self.client.pipeline(transaction=False)
            for key in part:
                pipe.unlink(self.pkey(key))
            self.expiry.queue_forget(pipe, part)
            found += [bool(flag) for flag in pipe.execute()[:len(part)]]
        return found

    def _slices(self, keys: list[str]) -> list[list[str]]:
        """``keys`` in runs of at most :attr:`delete_bytes` of records (at least one key
        each), one pipelined ``HGET s`` per key to learn the sizes.

        Redis frees a record HASH of fewer than 64 fields in its main thread even on
        ``UNLINK`` (below the lazy-free threshold): about a millisecond per 16 MB on the
        development machine.  One transaction over a page of big records would hold every
        other client for all of it; slices let their commands in between.  Small records
        still go a page at a time."""
        if len(keys) <= 1:
            return [keys] if keys else []
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.hget(self.pkey(key), SIZE_FIELD)
        sizes = [decimal(size) or 0 for size in pipe.execute()]
        out: list[list[str]] = [[]]
        total = 0
        for key, size in zip(keys, sizes, strict=True):
            if out[-1] and total + size > self.delete_bytes:
                out.append([])
                total = 0
            out[-1].append(key)
            total += size
        return out

    # -- retention by expiry (redis/expiry.py) -----------------------------------------------
    def supports_expiry(self) -> bool:
        return True

    def expire_records_after(self, ttl_s: float) -> None:
        if ttl_s < 0:
            raise ValueError(f"ttl_s must be >= 0, got {ttl_s!r}")
        self.expiry.ttl_s = float(ttl_s)

    def purge_expired(self, keys: Sequence[str] | None = None) -> int:
        """Drop the index entries of records Redis expired (all that are due, or those of
        ``keys``); return how many.  The retention sweeper's pass on this store."""
        with self.translate_errors("purge expired entries"):
            return self.expiry.purge(keys)

    def expired_entries(self, keys: Sequence[str]) -> list[str]:
        """Those of ``keys`` (index entries without payload) whose payload expired."""
        with self.translate_errors("check expiry entries"):
            return self.expiry.expired(keys)

    def list(self, prefix: str | None = None) -> list[str]:
        """The indexed keys, less those whose payload has expired (not yet purged)."""
        keys = super().list(prefix)
        with self.translate_errors("list keys"):
            due = self.expiry.due_mask(keys)
        return keys if due is None else [key for key, gone in zip(keys, due, strict=True)
                                         if not gone]

    # -- reads ------------------------------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        key = check_key(key)
        with self.translate_errors(f"get {key!r}"):
            fields = self.client.hgetall(self.pkey(key))
        if not fields:
            return None
        return assemble(key, fields)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """The values of ``keys`` in order (None where absent): one pipelined round trip
        per 256 keys instead of one per key."""
        keys = [check_key(key) for key in keys]
        out: list[bytes | None] = []
        for start in range(0, len(keys), _GET_MANY_BATCH):
            page = keys[start:start + _GET_MANY_BATCH]
            with self.translate_errors(f"get {len(page)} keys"):
                pipe = self.client.pipeline(transaction=False)
                for key in page:
                    pipe.hgetall(self.pkey(key))
                replies = pipe.execute()
            out += [assemble(key, fields) if fields else None
                    for key, fields in zip(page, replies, strict=True)]
        return out

    def read_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes] | None:
        """``(offset, length)`` byte ranges of the value under ``key``, fetching only the
        chunks they overlap (chunk-aligned: a chunk is read whole); None when absent.

        Two round trips: the chunk count, size and chunk length, then (one ``MULTI``) those
        chunks with the count, size and chunk length again — a record replaced in between
        is read whole instead, so a range never mixes two versions."""
        key = check_key(key)
        pkey = self.pkey(key)
        with self.translate_errors(f"get {key!r}"):
            pipe = self.client.pipeline(transaction=False)
            pipe.hmget(pkey, [COUNT_FIELD, SIZE_FIELD])
            pipe.hstrlen(pkey, "0")
            (count, size), chunk = pipe.execute()
        count, size = decimal(count), decimal(size)
        if count is None or size is None:
            return None if not self.exists(key) else self._ranges_of_whole(key, ranges)
        chunk = int(chunk) or 1
        wanted = sorted({number for offset, length in ranges if length > 0 and offset < size
                         for number in range(offset // chunk,
                                             min(offset + length - 1, size - 1) // chunk + 1)})
        with self.translate_errors(f"get {key!r}"):   # one MULTI: a consistent version
            pipe = self.client.pipeline(transaction=True)
            pipe.hmget(pkey, [COUNT_FIELD, SIZE_FIELD] + [str(n).encode() for n in wanted])
            pipe.hstrlen(pkey, "0")
            values, chunk_again = pipe.execute()
        if ((decimal(values[0]), decimal(values[1]), int(chunk_again) or 1) != (count, size, chunk)
                or any(value is None for value in values[2:])):
            return self._ranges_of_whole(key, ranges)           # replaced meanwhile
        chunks = dict(zip(wanted, values[2:], strict=True))
        out = []
        for offset, length in ranges:
            end = min(offset + max(length, 0), size)
            pieces = [chunks[number][max(offset - number * chunk, 0):end - number * chunk]
                      for number in range(offset // chunk, (end - 1) // chunk + 1)] \
                if end > offset else []
            out.append(b"".join(pieces))
        return out

    def open_ranges(self, key: str) -> RecordRangeView | BytesRangeView | None:
        """One version of the value under ``key`` to read byte ranges from (``size``,
        ``read``, ``unchanged``; a context manager), None when absent: the record is
        ``WATCH``ed, so ``unchanged()`` tells whether every read saw one version
        (:mod:`fd_routing_replay.store.redis.ranges`).  Sliced reads use it."""
        key = check_key(key)
        return open_record_ranges(self.client, self.pkey(key), key, self.translate_errors,
                                  self.get)

    def _ranges_of_whole(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes] | None:
        value = self.get(key)
        if value is None:
            return None
        return [bytes(value[offset:offset + max(length, 0)]) for offset, length in ranges]

    def exists(self, key: str) -> bool:
        key = check_key(key)
        with self.translate_errors(f"check {key!r}"):
            return bool(self.client.exists(self.pkey(key)))

    # -- used by fsck -----------------------------------------------------------------------
    def iter_payload_keys(self, count: int = 1000) -> Iterator[str | bytes]:
        """Every payload name of this namespace, whatever its Redis type (SCAN; O(all
        keys)): the store key (a str, not yet validated) of a name shaped ``rr:{ns/KEY}``,
        the whole raw name (bytes) of anything else under ``rr:{ns/`` (not UTF-8, no
        closing brace)."""
        pattern = self._scan_prefix + "*"
        prefix = self._scan_prefix.encode()
        with self.translate_errors("scan payloads"):
            for name in self.client.scan_iter(match=pattern, count=count):
                raw = name if isinstance(name, bytes) else name.encode("utf-8")
                if not raw.startswith(prefix):
                    continue
                if raw.endswith(b"}"):
                    try:
                        yield raw[len(prefix):-1].decode("utf-8")
                        continue
                    except UnicodeDecodeError:
                        pass
                yield raw

    def payloads_exist(self, keys: Sequence[str]) -> list[bool]:
        """For each key, whether its payload exists (one pipelined round trip per page)."""
        result: list[bool] = []
        with self.translate_errors("check payloads"):
            for start in range(0, len(keys), self.batch):
                pipe = self.client.pipeline(transaction=False)
                for key in keys[start:start + self.batch]:
                    pipe.exists(self.pkey(key))
                result.extend(bool(found) for found in pipe.execute())
        return result

    def payload_problems(self, keys: Sequence[str]) -> list[str | None]:
        """For each key, why its payload cannot be read back, or None (intact or gone):
        the layout checked without reading the data, two pipelined round trips per page
        (:func:`~fd_routing_replay.store.redis.records.record_problems`)."""
        result: list[str | None] = []
        with self.translate_errors("check records"):
            for start in range(0, len(keys), self.batch):
                page = keys[start:start + self.batch]
                result.extend(record_problems(self.client, [self.pkey(key) for key in page]))
        return result

    def quarantine(self, items: Sequence[str | bytes]) -> list[tuple[bool, str]]:
        """Move payloads out of the namespace without reading or deleting them.

        ``items`` are what :meth:`iter_payload_keys` yields (a store key, or a raw name).
        Each is renamed (``RENAMENX``) to ``rr:quarantine:<UTC time>:<its name>``: the same
        hash tag, so the same slot on a cluster, and outside every namespace's ``SCAN``
        pattern.  A name without a hash tag hashes elsewhere on a cluster: it is copied
        (``DUMP``/``RESTORE``) and then unlinked.  Returns ``(moved, where or why not)``.
        """
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        head = f"{self.key_prefix}:quarantine:{stamp}:".encode()
        result: list[tuple[bool, str]] = []
        with self.translate_errors("quarantine payloads"):
            for item in items:
                source = self.pkey(item).encode("utf-8") if isinstance(item, str) else item
                try:
                    target = self._move(source, head + source)
                except Exception as exc:  # noqa: BLE001 - e.g. gone meanwhile
                    if _is_connection_error(exc):
                        raise
                    result.append((False, f"left in place: {type(exc).__name__}: {exc}"))
                    continue
                result.append((True, printable(target)) if target is not None else
                              (False, f"left in place: {printable(head + source)} and "
                                      f"{_QUARANTINE_TRIES - 1} numbered names exist already"))
        return result

    def _move(self, source: bytes, target: bytes) -> bytes | None:
        """Rename ``source`` to ``target`` (or ``target#2``, ``#3``, … when taken: the
        suffix follows the hash tag); return the name used, None when all are taken."""
        for number in range(1, _QUARANTINE_TRIES + 1):
            name = target if number == 1 else target + b"#%d" % number
            try:
                if self.client.renamenx(source, name):
                    return name
                continue
            except Exception as exc:
                if not any(text in str(exc) for text in _OTHER_SLOT):
                    raise
            # No hash tag: the name hashes to another slot of the cluster.  Copy, then unlink.
            dump = self.client.dump(source)
            if dump is None:
                raise LookupError("it is gone")
            if self.client.exists(name):
                continue
            self.client.restore(name, 0, dump)
            self.client.unlink(source)
            return name
        return None

    def quarantine_hint(self) -> str:
        """Where quarantined payloads go and how to look at them."""
        pattern = f"{self.key_prefix}:quarantine:*"
        return (f"quarantined payloads are renamed to {self.key_prefix}:quarantine:<UTC time>:"
                f"<original name> in {self.location} (same slot, outside every namespace): "
                f"list them with `redis-cli --scan --pattern '{pattern}'`, inspect one with "
                "`redis-cli TYPE <name>` and `redis-cli HGETALL <name>`, delete it with "
                "`redis-cli UNLINK <name>`")

    # -- capabilities -------------------------------------------------------------------------
    def supports_record_check(self) -> bool:
        return True

    def supports_quarantine(self) -> bool:
        return True

    def supports_cross_process(self) -> bool:
        return True

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        with contextlib.suppress(Exception):
            self.client.close()

    def describe(self) -> str:
        mode = "cluster " if self.cluster else ""
        return f"redis {mode}{self.location} (namespace {self.namespace})"


def _is_connection_error(exc: BaseException) -> bool:
    return isinstance(translate_error(exc, ""), TransientStoreError)
