"""``MooncakeStore``: records in Mooncake Store (``mooncake_master`` + its segments).

Mooncake Store is a distributed in-memory object store: a master keeps the metadata of
every object, and the bytes live in *segments* of memory that clients mount (a client
with ``global_segment_size > 0`` contributes memory; ``mooncake_client`` is a dedicated
segment holder).  This backend wraps its Python client and guards its pitfalls
(docs/stores.md, "Mooncake Store"):

* **Deletes are O(matched).**  Our prefix-bucket index (:mod:`fd_routing_replay.store.index`) lives in Redis
  (``store.mooncake.index_url``); prefix deletes and ``clear()`` walk it and remove the
  objects with ``batch_remove`` (at most ``max_batch`` keys a call).  Mooncake's own
  ``remove_by_regex`` runs the regex over every key on the master (O(N), and it silently
  skips leased keys) and is never called.
* **A put replaces.**  Mooncake's ``put`` of an existing key answers 0 and keeps the old
  value; we write with ``upsert_parts`` — the record's parts go to the client as they are
  (no join in Python), the client copies them once into its registered buffer.
* **Leases.**  ``get``, ``is_exist`` and ``batch_is_exist`` grant the reader a lease
  (``--default_kv_lease_ttl``, 10 s by default) and a plain remove of a leased object fails
  with -706 (``OBJECT_HAS_LEASE``).  Our own put takes one (it re-checks its object), so a
  delete right after a put or a read is the normal case: ``force_remove: true`` (default)
  removes regardless; ``false`` retries leased keys until ``lease_wait_s`` and then fails
  with ``TransientStoreError`` naming them, their index entries restored.
* **No silent eviction.**  With ``pin: hard`` (default) objects are never evicted: a full
  store refuses puts (-200) and the writer retries or spills.  ``soft``/``none`` make
  records evictable, which leaves index entries without objects (``fd-rr fsck --repair``).
* **Empty values and errors** — Mooncake cannot store 0 bytes and ``get`` answers ``b""``
  both for a missing key and a failed read; every value is stored behind a 16-byte frame
  (:data:`FRAME`), so ``b""`` is never a value and is resolved with ``is_exist``.

Lifetime: objects live in the segments of the processes that mount them and in the
master's memory.  A master restart (without its HA mode) forgets every object: reads
answer None, the index still lists them until ``fd-rr fsck --repair`` drops them.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from typing import Any

from fd_routing_replay.errors import ConfigError, PermanentStoreError, TransientStoreError
from fd_routing_replay.store.base import Buffer
from fd_routing_replay.store.index import PrefixIndex
from fd_routing_replay.store.indexed import IndexedStore
from fd_routing_replay.store.mooncake.codes import (
    HINTS,
    INVALID_PARAMS,
    OBJECT_HAS_LEASE,
    OBJECT_NOT_FOUND,
    PERMANENT,
    error_name,
)

log = logging.getLogger("fd_routing_replay.store.mooncake")

__all__ = ["FRAME", "INDEX_KEY_PREFIX", "MooncakeStore"]

FRAME = b"fdrr-mooncake" + bytes([1]) + bytes(2)
"""16 bytes before every value: Mooncake cannot store an empty value and answers ``b""``
for a missing key; a versioned frame also tells our objects from foreign ones."""
INDEX_KEY_PREFIX = "rr:mc"
"""The index of namespace ``ns`` is ``rr:mc:idx:{ns}`` (apart from the redis store's)."""


class MooncakeStore(IndexedStore):
    """A :class:`RoutingStore` on one ``MooncakeDistributedStore`` client and a Redis index.

    Open it with :func:`open_mooncake_store` (or ``open_store``).  ``replicate_config`` is
    the ``ReplicateConfig`` every put uses; ``master_http`` (``host:port`` of the master's
    HTTP server, ``--metrics_port``) lets fsck list the objects.
    """

    scheme = "mooncake"

    def __init__(self, client: Any, redis_client: Any, namespace: str, *, location: str,
                 replicate_config: Any = None, local_buffer_size: int = 0,
                 force_remove: bool = True, lease_wait_s: float = 12.0,
                 max_batch: int = 1000, master_http: str = "", index_location: str = "",
                 transport: str = "tcp", index_buckets: int = 1) -> None:
        super().__init__(namespace)
        if max_batch < 1:
            raise ConfigError(f"store.mooncake.max_batch must be >= 1, got {max_batch}")
        self.client = client
        self.redis = redis_client
        self.index = PrefixIndex(redis_client, self.namespace, key_prefix=INDEX_KEY_PREFIX,
                                 batch=max_batch, buckets=index_buckets)
        self.location = location
        self.index_location = index_location
        self.transport = transport
        self.replicate_config = replicate_config
        self.local_buffer_size = local_buffer_size
        self.force_remove = force_remove
        self.lease_wait_s = lease_wait_s
        self.max_batch = max_batch
        self.delete_batch = max_batch
        self.master_http = master_http
        self._prefix = self.namespace + "/"
        self._closed = False
        self._close_lock = threading.Lock()

    # -- helpers ------------------------------------------------------------------------------
    def _mkey(self, key: str) -> str:
        return self._prefix + key

    def _failure(self, code: int, action: str, *, size: int | None = None) -> Exception:
        """The error for a negative Mooncake return code."""
        name = error_name(code)
        hint = HINTS.get(code, "")
        if code == INVALID_PARAMS and size is not None:
            if self.local_buffer_size and size > self.local_buffer_size:
                return PermanentStoreError(
                    f"{self.describe()}: cannot {action}: {size:,} bytes (record + 16-byte "
                    f"frame) exceed store.mooncake.local_buffer_size={self.local_buffer_size:,} "
                    f"(Mooncake {code} {name}); raise local_buffer_size above the largest record")
            hint = "the client's local buffer is busy with other transfers"
            return TransientStoreError(f"{self.describe()}: cannot {action}: Mooncake {code} "
                                       f"({name}): {hint}")
        message = f"{self.describe()}: cannot {action}: Mooncake {code} ({name})" + \
            (f": {hint}" if hint else "")
        return PermanentStoreError(message) if code in PERMANENT else TransientStoreError(message)

    # -- writes -------------------------------------------------------------------------------
    def put(self, key: str, value: Buffer) -> None:
        self.put_parts(key, [value])

    def put_parts(self, key: str, parts: Sequence[Buffer]) -> None:
        """Store ``FRAME + parts`` with ``upsert_parts``: the parts are handed over as they
        are (no join here); the client copies them once into its registered buffer."""
        key = self._keys([key])[0]
        views = [FRAME, *(memoryview(part).cast("B") for part in parts)]
        size = sum(len(view) for view in views)
        if self.local_buffer_size and size > self.local_buffer_size:
            raise self._failure(INVALID_PARAMS, f"put {key!r}", size=size)
        mkey = self._mkey(key)

        def write_payload() -> None:
            if self.replicate_config is not None:
                code = self.client.upsert_parts(mkey, *views, config=self.replicate_config)
            else:
                code = self.client.upsert_parts(mkey, *views)
            if code != 0:
                raise self._failure(code, f"put {key!r}", size=size)

        with self.translate_errors(f"put {key!r}"):
            # Object, entry, then a re-check that a racing delete did not take the object.
            self.index.add_confirmed(key, write_payload, self.payloads_exist)

    def _remove_objects(self, keys: list[str]) -> list[bool]:
        """Remove the objects of ``keys`` (batched); one flag per key: was it there.

        Leased objects (-706) are removed anyway with ``force_remove``; otherwise they are
        retried until ``lease_wait_s`` and then reported (their index entries are restored
        by :meth:`_delete_payloads`).
        """
        flags: dict[str, bool] = {}
        pending = list(keys)
        deadline = time.monotonic() + self.lease_wait_s
        delay = 0.05
        while pending:
            leased: list[str] = []
            for start in range(0, len(pending), self.max_batch):
                page = pending[start:start + self.max_batch]
                codes = self.client.batch_remove([self._mkey(k) for k in page],
                                                 self.force_remove)
                if len(codes) != len(page):
                    raise TransientStoreError(f"{self.describe()}: batch_remove answered "
                                              f"{len(codes)} codes for {len(page)} keys")
                for key, code in zip(page, codes, strict=True):
                    if code == 0:
                        flags[key] = True
                    elif code == OBJECT_NOT_FOUND:
                        flags.setdefault(key, False)
                    elif code == OBJECT_HAS_LEASE and not self.force_remove:
                        leased.append(key)
                    else:
                        raise self._failure(code, f"remove {key!r}")
            if leased and time.monotonic() >= deadline:
                raise _LeasedError(leased, self.lease_wait_s, self.describe())
            if leased:
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
            pending = leased
        return [flags[key] for key in keys]

    def _delete_payloads(self, keys: list[str]) -> list[bool]:
        try:
            return self._remove_objects(keys)
        except _LeasedError as exc:
            self.index.add(exc.keys)  # their objects are still there: keep them listed
            raise TransientStoreError(str(exc)) from None

    # -- reads ----------------------------------------------------------------------------------
    def get(self, key: str) -> memoryview | None:
        key = self._keys([key])[0]
        mkey = self._mkey(key)
        with self.translate_errors(f"get {key!r}"):
            value = self.client.get(mkey)
            if not value:  # missing, or a failed read: ask the master which
                code = self.client.is_exist(mkey)
                if code == 0:
                    return None
                if code == 1:
                    raise TransientStoreError(
                        f"{self.describe()}: get {key!r} failed though the object exists (a "
                        f"transfer from its segment failed; the Mooncake log says why)")
                raise self._failure(code, f"get {key!r}")
        view = memoryview(value)
        if view[:len(FRAME)] != FRAME:
            raise PermanentStoreError(
                f"{self.describe()}: the object {mkey!r} was not written by this store (no "
                f"{FRAME[:13]!r} frame)")
        return view[len(FRAME):]

    def exists(self, key: str) -> bool:
        key = self._keys([key])[0]
        with self.translate_errors(f"exists {key!r}"):
            return self.payloads_exist([key])[0]

    # -- fsck and doctor hooks ------------------------------------------------------------------
    def payloads_exist(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key's object exists (``batch_is_exist``; it takes a read lease)."""
        result: list[bool] = []
        for start in range(0, len(keys), self.max_batch):
            page = list(keys[start:start + self.max_batch])
            codes = self.client.batch_is_exist([self._mkey(k) for k in page])
            for key, code in zip(page, codes, strict=True):
                if code not in (0, 1):
                    raise self._failure(code if code < -1 else -900, f"check {key!r}")
                result.append(code == 1)
        return result

    def iter_payload_keys(self) -> Iterator[str]:
        """Every key with an object in this namespace, from the master's ``/get_all_keys``
        (O(all keys of the cluster); for fsck).  Needs ``store.mooncake.master_http``."""
        if not self.master_http:
            raise PermanentStoreError(
                f"{self.describe()}: listing objects needs store.mooncake.master_http (host:port "
                "of the master's HTTP server, its --metrics_port); Mooncake's client cannot list")
        url = f"http://{self.master_http}/get_all_keys"
        try:
            with urllib.request.urlopen(url, timeout=60) as answer:  # noqa: S310 - http only
                body = answer.read()
        except OSError as exc:
            raise TransientStoreError(f"{self.describe()}: cannot list objects at {url}: "
                                      f"{exc}") from exc
        prefix = self._prefix.encode()
        for line in body.split(b"\n"):
            if line.startswith(prefix):
                try:
                    yield line[len(prefix):].decode("utf-8")
                except UnicodeDecodeError:
                    continue

    # -- lifecycle ------------------------------------------------------------------------------
    def supports_cross_process(self) -> bool:
        return True

    def close(self) -> None:
        """Close the Mooncake client (its mounted segment, and the objects in it, go away
        with it) and the index connection.  Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        try:
            self.client.close()
        except Exception as exc:  # noqa: BLE001 - closing must not raise
            log.warning("%s: Mooncake close failed: %s", self.describe(), exc)
        with contextlib.suppress(Exception):
            self.redis.close()

    def describe(self) -> str:
        return (f"mooncake(namespace={self.namespace}, master={self.location}, "
                f"index={self.index_location}, transport={self.transport})")


class _LeasedError(Exception):
    def __init__(self, keys: list[str], waited_s: float, where: str) -> None:
        super().__init__(
            f"{where}: {len(keys)} object(s), e.g. {keys[0]!r}, stayed leased by readers "
            f"(Mooncake -706 OBJECT_HAS_LEASE) for {waited_s:g}s; retry, or set "
            "store.mooncake.force_remove: true")
        self.keys = keys
