"""Records stored in Redis itself (single node, TLS, ACL, or Redis Cluster).

Layout, per namespace ``ns`` (``rr`` is the key prefix):

* ``rr:{ns/KEY}`` — one HASH per record: fields ``n`` (chunk count), ``s`` (total size)
  and ``0`` … ``n-1``, the record cut into chunks of at most ``chunk_bytes``.  One key per
  record means an overwrite is one single-slot ``MULTI``/``EXEC`` (``UNLINK`` + ``HSET``)
  and a reader's ``HGETALL`` sees either the old or the new record, never a mix; the
  chunks share the record's hash tag by construction.  ``UNLINK`` frees big records in
  Redis's background thread.
* ``rr:idx:{ns}`` — the prefix-bucket index (:mod:`fd_routing_replay.store.index`).

Crash ordering: on a single node a put writes payload and index entry in one transaction.
On a cluster they live in different slots, so the payload is written first and indexed
second; deletes remove payloads first and index entries second.  A crash therefore leaves
at worst an unindexed payload or an index entry without payload; ``fd-rr fsck`` repairs
both (:mod:`fd_routing_replay.store.fsck`).

Errors: connection failures and timeouts (server down, restarting, loading, cluster
resharding) raise ``TransientStoreError``; bad credentials, missing permissions and
everything else raise ``PermanentStoreError``.  redis-py reconnects by itself, so a store
keeps working after Redis comes back without being reopened.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from fd_routing_replay.errors import PermanentStoreError, StoreError, TransientStoreError
from fd_routing_replay.keys import check_key
from fd_routing_replay.store.base import Buffer, RoutingStore
from fd_routing_replay.store.index import PrefixIndex

KEY_PREFIX = "rr"
DEFAULT_CHUNK_BYTES = 8 * 2**20
_COUNT, _SIZE = b"n", b"s"
_PAGE = 1000  # keys per pipelined payload batch


def payload_key(namespace: str, key: str, key_prefix: str = KEY_PREFIX) -> str:
    """The Redis key of a record's HASH: ``rr:{ns/KEY}`` (hash tag = namespace and key)."""
    return f"{key_prefix}:{{{namespace}/{key}}}"


def _chunks(parts: Sequence[Buffer], chunk_bytes: int) -> Iterator[bytes | memoryview]:
    """Cut the concatenation of ``parts`` into chunks without joining what needs no join."""
    pending: list[memoryview] = []
    pending_size = 0
    for part in parts:
        view = memoryview(part).cast("B")
        while view.nbytes:
            room = chunk_bytes - pending_size
            piece, view = view[:room], view[room:]
            pending.append(piece)
            pending_size += piece.nbytes
            if pending_size == chunk_bytes:
                yield pending[0] if len(pending) == 1 else b"".join(pending)
                pending, pending_size = [], 0
    if pending:
        yield pending[0] if len(pending) == 1 else b"".join(pending)


class RedisStore(RoutingStore):
    """Routing records in Redis with the prefix-bucket index beside them.

    ``client`` is a redis-py ``Redis`` or ``RedisCluster`` with ``decode_responses=False``;
    use :func:`open_redis_store` to build one from a config.  Thread-safe.
    """

    scheme = "redis"

    def __init__(self, client: Any, namespace: str, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 cluster: bool = False, location: str = "redis", key_prefix: str = KEY_PREFIX,
                 batch: int = _PAGE) -> None:
        super().__init__(namespace)
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self.client = client
        self.cluster = cluster
        self.chunk_bytes = chunk_bytes
        self.location = location
        self.key_prefix = key_prefix
        self.batch = batch
        self.index = PrefixIndex(client, self.namespace, key_prefix=key_prefix, batch=batch)
        self._closed = False
        self._close_lock = threading.Lock()
        self._scan_prefix = f"{key_prefix}:{{{self.namespace}/"

    # -- helpers ------------------------------------------------------------------------
    def _pkey(self, key: str) -> str:
        return payload_key(self.namespace, key, self.key_prefix)

    def translate_errors(self, action: str) -> contextlib.AbstractContextManager[None]:
        """Turn redis-py exceptions raised inside into Transient/PermanentStoreError."""
        return translating_errors(self, action)

    # -- writes -----------------------------------------------------------------------------
    def put(self, key: str, value: Buffer) -> None:
        self.put_parts(key, [value])

    def put_parts(self, key: str, parts: Sequence[Buffer]) -> None:
        """Store the concatenation of ``parts`` chunk by chunk (no full join client-side)."""
        key = check_key(key)
        mapping: dict[bytes, Any] = {}
        size = 0
        for number, chunk in enumerate(_chunks(list(parts), self.chunk_bytes)):
            mapping[str(number).encode()] = chunk
            size += memoryview(chunk).nbytes
        mapping[_COUNT] = len(mapping)
        mapping[_SIZE] = size
        pkey = self._pkey(key)
        with self.translate_errors(f"put {key!r}"):
            pipe = self.client.pipeline(transaction=True)
            pipe.unlink(pkey)
            pipe.hset(pkey, mapping=mapping)
            if self.cluster:  # index lives in another slot: payload first, then index
                pipe.execute()
                self.index.add([key])
            else:  # one node: payload and index entry in one transaction
                self.index.add([key], pipeline=pipe)
                pipe.execute()

    def delete(self, keys: Iterable[str]) -> int:
        checked = self._keys(keys)
        removed = 0
        with self.translate_errors("delete keys"):
            for start in range(0, len(checked), self.batch):
                page = checked[start:start + self.batch]
                removed += self._delete_payloads(page)
                self.index.remove(page)
        return removed

    def _delete_payloads(self, keys: list[str]) -> int:
        """UNLINK the keys' payloads in one round trip; return how many existed.

        One node: one multi-key UNLINK per ``batch`` keys.  Cluster: the payloads live in
        different slots, so one UNLINK per key, pipelined (grouped per node by redis-py).
        """
        pipe = self.client.pipeline(transaction=False)
        if self.cluster:
            for key in keys:
                pipe.unlink(self._pkey(key))
        else:
            for start in range(0, len(keys), self.batch):
                pipe.unlink(*(self._pkey(key) for key in keys[start:start + self.batch]))
        return int(sum(pipe.execute()))

    def delete_prefix(self, prefixes: Iterable[str]) -> dict[str, int]:
        checked = self._prefixes(prefixes)
        with self.translate_errors(f"delete prefixes {checked[:3]!r}"):
            return self.index.delete_prefixes(checked, self._delete_payloads)

    def clear(self) -> int:
        with self.translate_errors("clear"):
            return self.index.clear(self._delete_payloads)

    # -- reads ------------------------------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        key = check_key(key)
        with self.translate_errors(f"get {key!r}"):
            fields = self.client.hgetall(self._pkey(key))
        if not fields:
            return None
        return _assemble(key, fields)

    def exists(self, key: str) -> bool:
        key = check_key(key)
        with self.translate_errors(f"check {key!r}"):
            return bool(self.client.exists(self._pkey(key)))

    def list(self, prefix: str | None = None) -> list[str]:
        with self.translate_errors("list keys"):
            if prefix is None:
                return list(self.index.all())
            return list(self.index.match(prefix))

    # -- used by fsck -----------------------------------------------------------------------
    def iter_payload_keys(self, count: int = 1000) -> Iterator[str]:
        """Every store key of this namespace that has a payload (SCAN; O(all keys))."""
        pattern = self._scan_prefix + "*"
        with self.translate_errors("scan payloads"):
            for raw in self.client.scan_iter(match=pattern, count=count, _type="hash"):
                name = raw.decode("utf-8") if isinstance(raw, bytes) else raw
                if name.startswith(self._scan_prefix) and name.endswith("}"):
                    yield name[len(self._scan_prefix):-1]

    def payloads_exist(self, keys: Sequence[str]) -> list[bool]:
        """For each key, whether its payload exists (one pipelined round trip per page)."""
        result: list[bool] = []
        with self.translate_errors("check payloads"):
            for start in range(0, len(keys), self.batch):
                pipe = self.client.pipeline(transaction=False)
                for key in keys[start:start + self.batch]:
                    pipe.exists(self._pkey(key))
                result.extend(bool(found) for found in pipe.execute())
        return result

    # -- capabilities -------------------------------------------------------------------------
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


def _assemble(key: str, fields: dict[bytes, bytes]) -> bytes:
    try:
        count, size = int(fields[_COUNT]), int(fields[_SIZE])
        chunks = [fields[str(number).encode()] for number in range(count)]
    except (KeyError, ValueError) as exc:
        raise PermanentStoreError(
            f"redis record {key!r} is malformed (fields {sorted(fields)[:8]}): missing or bad "
            f"{exc}; delete it and write it again") from exc
    value = chunks[0] if count == 1 else b"".join(chunks)
    if len(value) != size:
        raise PermanentStoreError(
            f"redis record {key!r} has {len(value)} bytes but its header says {size}")
    return value


@contextlib.contextmanager
def translating_errors(store: Any, action: str) -> Iterator[None]:
    """Map client exceptions raised inside to Transient/PermanentStoreError.

    Shared by every Redis-backed store (``store`` needs ``_closed`` and ``describe()``);
    our own StoreErrors pass through unchanged.
    """
    if store._closed:
        raise PermanentStoreError(f"{store.describe()}: cannot {action}: store is closed")
    try:
        yield
    except StoreError:
        raise
    except Exception as exc:
        raise translate_error(exc, f"{store.describe()}: cannot {action}") from exc


def translate_error(exc: BaseException, context: str) -> StoreError:
    """Map a redis-py exception to ``TransientStoreError`` or ``PermanentStoreError``."""
    import redis.exceptions as rex

    transient_types: tuple[type[BaseException], ...] = (
        rex.BusyLoadingError, rex.TryAgainError, rex.ClusterDownError, rex.OutOfMemoryError,
        rex.ReadOnlyError)
    permanent_types: tuple[type[BaseException], ...] = (
        rex.AuthenticationError, rex.AuthorizationError, rex.NoPermissionError)
    message = f"{context}: {type(exc).__name__}: {exc}"
    if isinstance(exc, permanent_types):
        return PermanentStoreError(message + " (check the ACL user name and password)")
    if isinstance(exc, transient_types):
        return TransientStoreError(message)
    if isinstance(exc, rex.ConnectionError | rex.TimeoutError | ConnectionError | TimeoutError):
        return TransientStoreError(message)
    if isinstance(exc, rex.RedisClusterException) and "connect" in str(exc).lower():
        return TransientStoreError(message)
    if isinstance(exc, rex.ResponseError) and str(exc).startswith(("LOADING", "MASTERDOWN")):
        return TransientStoreError(message)
    return PermanentStoreError(message)


# -- factory -----------------------------------------------------------------------------------

def _redacted(url: str) -> str:
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def redis_client_from_config(store_config: Any, *, retry: Any = None) -> tuple[Any, bool, str]:
    """Build a redis-py client from a store config: ``(client, is_cluster, redacted_url)``.

    The URL is ``store.url`` when it names a Redis scheme, else ``store.redis.url``.
    ``redis+cluster://`` or ``store.redis.cluster: true`` select a ``RedisCluster``;
    ``rediss://`` enables TLS (``store.redis.ssl_ca_certs`` verifies the server);
    ``store.redis.username`` / ``password`` override credentials in the URL.
    """
    import redis
    from redis.backoff import ExponentialBackoff
    from redis.retry import Retry

    settings = store_config.redis
    url = store_config.url or settings.url
    scheme = urlsplit(url).scheme
    if scheme not in ("redis", "rediss", "redis+cluster"):
        raise PermanentStoreError(
            f"store url {_redacted(url)!r} has scheme {scheme!r}; the redis store takes "
            "redis://, rediss:// or redis+cluster://")
    cluster = bool(settings.cluster) or scheme == "redis+cluster"
    if scheme == "redis+cluster":
        url = "redis" + url[len("redis+cluster"):]
    if retry is None:  # one quick retry rides over a connection the server dropped
        retry = Retry(ExponentialBackoff(cap=0.5, base=0.05), retries=1)
    kwargs: dict[str, Any] = {
        "socket_timeout": settings.socket_timeout_s,
        "socket_connect_timeout": settings.socket_timeout_s,
        "retry": retry,
        "decode_responses": False,
        "protocol": 2,  # RESP2: replies parse ~1.5x faster in pure-Python redis-py
    }
    if settings.username:
        kwargs["username"] = settings.username
    if settings.password:
        kwargs["password"] = settings.password
    if urlsplit(url).scheme == "rediss" and settings.ssl_ca_certs:
        kwargs["ssl_ca_certs"] = settings.ssl_ca_certs
    try:
        if cluster:
            path = urlsplit(url).path.strip("/")
            if path not in ("", "0"):
                raise PermanentStoreError(
                    f"store url {_redacted(url)!r} selects database {path!r}; Redis Cluster "
                    "only has database 0")
            client = redis.RedisCluster.from_url(url, **kwargs)
        else:
            client = redis.Redis.from_url(url, **kwargs)
    except StoreError:
        raise
    except Exception as exc:
        raise translate_error(exc, f"cannot connect to {_redacted(url)}") from exc
    return client, cluster, _redacted(url)


def open_redis_store(store_config: Any) -> RedisStore:
    """Factory for ``type: redis`` and ``redis://``, ``rediss://``, ``redis+cluster://``."""
    client, cluster, location = redis_client_from_config(store_config)
    return RedisStore(client, store_config.namespace, chunk_bytes=store_config.redis.chunk_bytes,
                      cluster=cluster, location=location)
