"""``P2PStoreStore``: records in P2PStore, RDMA through Mooncake or its TCP transport.

P2PStore (PyPI ``p2pstore``) keeps every payload in the memory of the process that put it
(the *provider*) and publishes ``p2p:files:{key}`` in Redis (its *metadata server*); a
reader looks the key up and pulls the bytes from the provider over RDMA or TCP.  This
backend wraps its client and guards its pitfalls (docs/stores.md, "P2PStore"):

* **Deletes are O(matched).**  Our prefix-bucket index (:mod:`fd_routing_replay.store.index`) lives in the same
  Redis; prefix deletes and ``clear()`` walk it and remove payloads with P2PStore's
  exact-key ``delete_batch`` (at most ``max_delete_batch`` keys a call).  Its O(N)
  ``delete_prefix*``, ``list`` and its store-wide ``clear`` are never called.
* **No key is silently dropped.**  P2PStore skips any key containing ``88888888`` (and
  still returns True).  Stored keys are ``{ns}/{key}`` with ``%`` -> ``%25`` and
  ``8`` -> ``%38``, so no stored key contains two ``8`` in a row (:mod:`.keys`).
* **Logs never land in the working directory.**  ``P2P_LOG_DIR`` is set before the
  import (``store.p2pstore.log_dir``, else ``$P2P_LOG_DIR``, else a directory under the
  temp dir); its stdout prints are captured into our log at DEBUG; its level defaults
  to WARNING (set ``P2PSTORE_LOG_LEVEL`` to change it).
* **A gone provider is an error, not a silent None.**  Before a transfer the reader checks
  that the provider is still registered, is the same process that put the record, and
  answers (one short probe); :class:`ProviderUnavailableError` names it.  P2PStore itself
  would retry for ~3.5 s and then return None.
* **Memory held is visible.**  :meth:`P2PStoreStore.provider_bytes` reports the bytes this
  process serves; :meth:`P2PStoreStore.reclaim_orphans` frees payloads whose metadata is
  gone without a delete event (a pub/sub message lost while disconnected).
* **Empty values** cannot be transferred by P2PStore (``data_size <= 0``): every value is
  stored behind a 16-byte frame (:data:`FRAME`), built in the one copy a put makes anyway
  and skipped by a zero-copy view on get.

``layout: fastdeploy`` (:mod:`.fastdeploy`) stores FastDeploy's own bare keys and
raw padded values instead, for trainers that read what FastDeploy writes.

Lifetime: records live as long as their provider.  ``close()`` (like P2PStore's own
``close``) unregisters every record this process provides and drops them from the index.

Redis Cluster is not supported by P2PStore (its client fails to start on one, and its Lua
scripts take keys of several slots); use a single Redis or Sentinel
(``redis+sentinel://``) as metadata server.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from fd_routing_replay.errors import (
    ConfigError,
    PermanentStoreError,
    ProviderUnavailableError,
    TransientStoreError,
)
from fd_routing_replay.store.base import Buffer
from fd_routing_replay.store.index import PrefixIndex
from fd_routing_replay.store.indexed import IndexedStore
from fd_routing_replay.store.p2pstore.keys import (
    FILE_INDEX,
    FILE_PREFIX,
    PROVIDER_PREFIX,
    decode_component,
    encode_component,
    glob_escape,
)
from fd_routing_replay.store.p2pstore.runtime import (
    AsyncBridge,
    LogWriter,
    close_tcp_listeners,
    probe_provider,
)

log = logging.getLogger("fd_routing_replay.store.p2pstore")

__all__ = ["DEFAULT_OP_TIMEOUT_S", "FRAME", "P2PStoreStore"]

DEFAULT_OP_TIMEOUT_S = 120.0
FRAME = b"fdrr-p2p" + bytes([1]) + bytes(7)
"""16 bytes before every value: P2PStore cannot carry an empty value, and a versioned
frame tells our payloads from foreign ones.  16 keeps the record's alignment."""


class P2PStoreStore(IndexedStore):
    """A :class:`RoutingStore` on one P2PStore client, scoped to one namespace.

    Open it with :func:`open_p2pstore_store` (or ``open_store``); ``client`` is a
    ``p2pstore.P2PClient``, ``redis_client`` a redis-py client on the same Redis as its
    metadata server, ``bridge`` the event loop its async API runs on.
    """

    scheme = "p2pstore"

    def __init__(self, client: Any, redis_client: Any, bridge: AsyncBridge, namespace: str, *,
                 location: str, transport: str, max_delete_batch: int = 1000,
                 probe_timeout_s: float = 1.0, probe_interval_s: float = 1.0,
                 op_timeout_s: float = DEFAULT_OP_TIMEOUT_S,
                 log_dir: str = "") -> None:
        super().__init__(namespace)
        if not 1 <= max_delete_batch <= 1000:
            raise ConfigError(f"store.p2pstore.max_delete_batch must be 1..1000, got "
                              f"{max_delete_batch}")
        self.client = client
        self.redis = redis_client
        self.index = PrefixIndex(redis_client, namespace)
        self.location = location
        self.transport = transport
        self.log_dir = log_dir
        self.max_delete_batch = max_delete_batch
        self.delete_batch = max_delete_batch
        self.probe_timeout_s = probe_timeout_s
        self.probe_interval_s = probe_interval_s
        self._healthy: dict[tuple[str, str], float] = {}  # (provider, owner) -> last probe
        self.op_timeout_s = op_timeout_s
        self._bridge = bridge
        self._ns_prefix = encode_component(self.namespace) + "/"
        self._closed = False
        self._close_lock = threading.Lock()

    # -- helpers ------------------------------------------------------------------------------
    def _skey(self, key: str) -> str:
        return self._ns_prefix + encode_component(key)

    def _key_of(self, stored: str) -> str | None:
        if not stored.startswith(self._ns_prefix):
            return None
        return decode_component(stored[len(self._ns_prefix):])

    def _run(self, coroutine: Any, action: str) -> Any:
        try:
            return self._bridge.run(coroutine, self.op_timeout_s)
        except TimeoutError as exc:
            raise TransientStoreError(f"{self.describe()}: {action} did not finish within "
                                      f"{self.op_timeout_s:g}s") from exc

    # -- writes -------------------------------------------------------------------------------
    def put(self, key: str, value: Buffer) -> None:
        self.put_parts(key, [value])

    def put_parts(self, key: str, parts: Sequence[Buffer]) -> None:
        key = self._keys([key])[0]
        # One new immutable buffer: P2PStore takes one object and serves (over RDMA,
        # registers) that very object, so a caller reusing its buffer must not reach it.
        self._publish(key, b"".join([FRAME, *parts]))

    def _publish(self, key: str, data: Any) -> None:
        """Hand ``data`` (a new object nobody else holds) to P2PStore, then index ``key``."""
        def publish() -> None:
            if not self._run(self.client.put(self._skey(key), data), f"put {key!r}"):
                raise TransientStoreError(
                    f"{self.describe()}: P2PStore refused put {key!r} (it returned False; "
                    f"its log under {self.log_dir} says why)")

        with self.translate_errors(f"put {key!r}"):
            # Payload, entry, then a re-check that a racing delete did not take the payload.
            self.index.add_confirmed(key, publish, self.payloads_exist)

    def _delete_payloads(self, keys: list[str]) -> list[bool]:
        """Delete the payloads of ``keys`` (exact keys, batched); one flag per key: was it there."""
        flags: list[bool] = []
        for start in range(0, len(keys), self.max_delete_batch):
            page = keys[start:start + self.max_delete_batch]
            found = self.payloads_exist(page)
            flags.extend(bool(f) for f in found)
            present = [key for key, here in zip(page, found, strict=True) if here]
            if not present:
                continue
            results = self._run(self.client.delete_batch([self._skey(k) for k in present]),
                                "delete_batch")
            failed = [k for k in present if not results.get(self._skey(k), False)]
            if failed:
                raise TransientStoreError(
                    f"{self.describe()}: P2PStore delete_batch failed for {len(failed)} key(s), "
                    f"e.g. {failed[:3]}")
        return flags

    # -- reads ----------------------------------------------------------------------------------
    def _metadata(self, key: str) -> dict | None:
        raw = self.redis.get(FILE_PREFIX + self._skey(key))
        return json.loads(raw) if raw else None

    def get(self, key: str) -> bytes | memoryview | None:
        key = self._keys([key])[0]
        value = self._fetch(key)
        return None if value is None else self._payload(key, value)

    def _fetch(self, key: str) -> Any:
        """What P2PStore's ``get`` returns for ``key`` (None when nothing is stored)."""
        with self.translate_errors(f"get {key!r}"):
            entry = self._metadata(key)
            if entry is None:
                return None
            provider = str(entry.get("host", ""))
            self._check_provider(key, provider, entry)
            value = self._run(self.client.get(self._skey(key)), f"get {key!r}")
            if value is None:
                entry = self._metadata(key)
                if entry is None:
                    return None  # deleted meanwhile
                self._check_provider(key, provider, entry, use_cache=False)
                raise ProviderUnavailableError(
                    f"{self.describe()}: record {key!r} is registered but its provider "
                    f"{provider} did not deliver it", key=key, provider=provider)
        return value

    def _payload(self, key: str, value: Any) -> memoryview:
        """The stored bytes behind our frame, as a zero-copy view."""
        view = memoryview(value) if isinstance(value, bytes | bytearray | memoryview) else None
        if view is None or view[:len(FRAME)] != FRAME:
            raise PermanentStoreError(
                f"{self.describe()}: the payload of {key!r} was not written by this store "
                f"(no {FRAME[:8]!r} frame; got {type(value).__name__})")
        return view[len(FRAME):]

    def _check_provider(self, key: str, provider: str, entry: dict, *,
                        use_cache: bool = True) -> None:
        """Fail fast, naming the provider, when it is gone, replaced or does not answer.

        A provider that passed this check less than ``probe_interval_s`` ago is trusted
        (a burst of per-layer gets probes once); if it died since, P2PStore's own retries
        fail and :meth:`get` checks again without the cache.
        """
        metadata = entry.get("metadata") or {}
        owner = str(metadata.get("client_id") or "")
        checked = self._healthy.get((provider, owner))
        now = time.monotonic()
        if use_cache and checked is not None and now - checked < self.probe_interval_s:
            return
        self._healthy.pop((provider, owner), None)
        raw = self.redis.get(PROVIDER_PREFIX + provider)
        if not raw:
            raise ProviderUnavailableError(
                f"{self.describe()}: the provider {provider} holding {key!r} is no longer "
                f"registered (it closed or its registration expired); the record is lost "
                f"with it", key=key, provider=provider)
        try:
            current = json.loads(raw).get("client_id")
        except (ValueError, AttributeError):
            current = None
        if owner and current and owner != current:
            raise ProviderUnavailableError(
                f"{self.describe()}: the provider {provider} that held {key!r} restarted "
                f"(client {owner} was replaced by {current}); the record was lost with the "
                f"old process", key=key, provider=provider)
        tcp = metadata.get("buffer_ptr") is None
        problem = probe_provider(provider, self.probe_timeout_s, speak_tcp_transport=tcp)
        if problem:
            raise ProviderUnavailableError(
                f"{self.describe()}: the provider {provider} holding {key!r} does not answer "
                f"({problem}); if that process is gone the record is lost with it",
                key=key, provider=provider)
        if len(self._healthy) > 4096:
            self._healthy.clear()
        self._healthy[(provider, owner)] = now

    def exists(self, key: str) -> bool:
        key = self._keys([key])[0]
        with self.translate_errors(f"exists {key!r}"):
            return bool(self.redis.exists(FILE_PREFIX + self._skey(key)))

    # -- fsck and doctor hooks ------------------------------------------------------------------
    def iter_payload_keys(self, count: int = 1000) -> Iterator[str | bytes]:
        """Every store key with P2PStore metadata in this namespace (SSCAN of its key set); a
        member that is not UTF-8 comes back as bytes (fsck reports it)."""
        with self.translate_errors("scan payloads"):
            pattern = glob_escape(self._ns_prefix).encode() + b"*"
            for member in self.redis.sscan_iter(FILE_INDEX, match=pattern, count=count):
                if isinstance(member, bytes):
                    try:
                        member = member.decode("utf-8")
                    except UnicodeDecodeError:
                        yield member          # not a key: fsck reports it, never indexes it
                        continue
                key = self._key_of(member)
                if key is not None:
                    yield key

    def payloads_exist(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key has P2PStore metadata (one pipelined round trip)."""
        if not keys:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for key in keys:
            pipe.exists(FILE_PREFIX + self._skey(key))
        return [bool(found) for found in pipe.execute()]

    # -- provider memory ------------------------------------------------------------------------
    def _registrations(self) -> dict[str, dict]:
        """P2PStore's table of what this process serves: stored key -> registration."""
        table = getattr(self.client, "_registered_keys", None)
        lock = getattr(self.client, "_registered_keys_lock", None)
        if not isinstance(table, dict):
            return {}
        with lock if lock is not None else contextlib.nullcontext():
            return {k: v for k, v in table.items() if isinstance(v, dict)}

    def provider_bytes(self) -> int:
        """Bytes of payload this process holds for readers (released on delete events)."""
        return sum(int(reg.get("bytes") or 0) for reg in self._registrations().values())

    def provided_keys(self) -> list[str]:
        """Store keys of this namespace whose payload this process serves."""
        keys = (self._key_of(stored) for stored in self._registrations())
        return sorted(key for key in keys if key is not None)

    def reclaim_orphans(self) -> int:
        """Free payloads whose metadata is gone or now names another provider; return bytes.

        P2PStore frees a payload when a delete event arrives over pub/sub; a message lost
        while the subscription was down leaks it until the process exits.
        """
        registrations = self._registrations()
        if not registrations:
            return 0
        stored = list(registrations)
        with self.translate_errors("reclaim orphans"):
            values = self.redis.mget([FILE_PREFIX + s for s in stored])
        release = getattr(self.client, "_on_file_unregister", None)
        freed = 0
        for skey, raw in zip(stored, values, strict=True):
            registration = registrations[skey]
            meta = (json.loads(raw).get("metadata") or {}) if raw else {}
            if raw and str(meta.get("put_id")) == str(registration.get("put_id")):
                continue  # still the published generation
            if release is not None:
                release(skey, registration.get("put_id"), getattr(self.client, "client_id", None))
                freed += int(registration.get("bytes") or 0)
        return freed

    # -- lifecycle ------------------------------------------------------------------------------
    def supports_cross_process(self) -> bool:
        return True

    def close(self) -> None:
        """Unregister what this process provides (P2PStore's close), drop it from the index,
        release threads, the loop and the transport's listening socket.  Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        provided = self.provided_keys()
        try:
            with contextlib.redirect_stdout(LogWriter()):
                self.client.close()
        except Exception as exc:  # noqa: BLE001 - closing must not raise
            log.warning("%s: P2PStore close failed: %s", self.describe(), exc)
        close_tcp_listeners(self.client)
        try:
            if provided:  # payload (metadata) first, index second
                still = [k for k, found in zip(provided, self.payloads_exist(provided),
                                               strict=True) if not found]
                self.index.remove(still)
        except Exception as exc:  # noqa: BLE001
            log.warning("%s: could not drop %d closed record(s) from the index (fd-rr fsck "
                        "--repair will): %s", self.describe(), len(provided), exc)
        self._bridge.close()
        try:
            self.redis.close()
        except Exception:  # noqa: BLE001
            pass

    def describe(self) -> str:
        return (f"p2pstore(namespace={self.namespace}, metadata={self.location}, "
                f"transport={self.transport})")
