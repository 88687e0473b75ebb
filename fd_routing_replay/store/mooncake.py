"""Records in Mooncake Store (``mooncake_master`` + ``MooncakeDistributedStore``).

Mooncake Store is a distributed in-memory object store: a master keeps the metadata of
every object, and the bytes live in *segments* of memory that clients mount (a client
with ``global_segment_size > 0`` contributes memory; ``mooncake_client`` is a dedicated
segment holder).  This backend wraps its Python client and guards its pitfalls
(docs/stores.md, "Mooncake Store"):

* **Deletes are O(matched).**  Our prefix-bucket index (:mod:`.index`) lives in Redis
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
import dataclasses
import json
import logging
import os
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar
from urllib.parse import parse_qs, urlsplit

from fd_routing_replay import _parse
from fd_routing_replay.config_fields import nonempty
from fd_routing_replay.errors import ConfigError, PermanentStoreError, TransientStoreError
from fd_routing_replay.keys import check_namespace
from fd_routing_replay.redact import redact_text, redact_url
from fd_routing_replay.store.backend import (
    Capability,
    RedisTarget,
    Section,
    StoreBackend,
    option,
)
from fd_routing_replay.store.base import Buffer
from fd_routing_replay.store.index import PrefixIndex
from fd_routing_replay.store.indexed import IndexedStore

log = logging.getLogger(__name__)

__all__ = ["ERROR_CODES", "FRAME", "MooncakeStore", "mooncake_settings", "open_mooncake_store"]

FRAME = b"fdrr-mooncake" + bytes([1]) + bytes(2)
"""16 bytes before every value: Mooncake cannot store an empty value and answers ``b""``
for a missing key; a versioned frame also tells our objects from foreign ones."""
INDEX_KEY_PREFIX = "rr:mc"
"""The index of namespace ``ns`` is ``rr:mc:idx:{ns}`` (apart from the redis store's)."""
PINS = ("hard", "soft", "none")

# Mooncake Store's ErrorCode (mooncake-store/include/types.h) as its Python client returns them.
OBJECT_NOT_FOUND, OBJECT_HAS_LEASE, NO_AVAILABLE_HANDLE, INVALID_PARAMS = -704, -706, -200, -600
ERROR_CODES: dict[int, str] = {
    -1: "INTERNAL_ERROR", -10: "BUFFER_OVERFLOW", -101: "SEGMENT_NOT_FOUND",
    -103: "CLIENT_NOT_FOUND", -200: "NO_AVAILABLE_HANDLE", -300: "INVALID_VERSION",
    -400: "INVALID_KEY", -500: "WRITE_FAIL", -600: "INVALID_PARAMS", -601: "ILLEGAL_CLIENT",
    -700: "INVALID_WRITE", -701: "INVALID_READ", -702: "INVALID_REPLICA",
    -703: "REPLICA_IS_NOT_READY", -704: "OBJECT_NOT_FOUND", -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE", -707: "LEASE_EXPIRED", -708: "OBJECT_HAS_REPLICATION_TASK",
    -712: "REPLICA_IS_GONE", -714: "OBJECT_REPLICA_BUSY", -800: "TRANSFER_FAIL",
    -801: "CHECKSUM_MISMATCH", -900: "RPC_FAIL", -901: "RPC_TIMEOUT",
    -1010: "UNAVAILABLE_IN_CURRENT_STATUS", -1011: "UNAVAILABLE_IN_CURRENT_MODE",
}
_HINTS = {
    -200: "no mounted segment has room: the segments are full of pinned records or none is "
          "mounted (run mooncake_client, or give a long-lived process "
          "store.mooncake.global_segment_size > 0); delete records or add segments",
    -400: "Mooncake rejected the key",
    -601: "the master does not know this client (it restarted?); reopen the store",
    -706: "the object is leased by a reader (a get/exists in the last lease TTL)",
    -900: "the master does not answer (down or restarting?)",
    -901: "the master did not answer in time",
}
_PERMANENT = frozenset({-1, -10, -300, -400, -601, -705})
"""Codes a retry cannot fix; every other failure (RPC, transfer, busy, full) is transient."""


def error_name(code: int) -> str:
    return ERROR_CODES.get(code, "unknown error")


# -- the store -----------------------------------------------------------------------------------

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
        hint = _HINTS.get(code, "")
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
        return PermanentStoreError(message) if code in _PERMANENT else TransientStoreError(message)

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

    def segment_endpoints(self) -> list[str]:
        """Transport endpoints of the mounted segments (``/get_all_segments``), or []."""
        if not self.master_http:
            return []
        with urllib.request.urlopen(f"http://{self.master_http}/get_all_segments",  # noqa: S310
                                    timeout=10) as answer:
            return [line for line in answer.read().decode().split("\n") if line]

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


# -- factory -------------------------------------------------------------------------------------

_URL_OPTIONS = ("index_url", "metadata_server", "protocol", "device", "local_host",
                "global_segment_size", "local_buffer_size", "replica_num", "pin",
                "force_remove", "lease_wait_s", "max_batch", "master_http", "preferred_segment")


def mooncake_settings(store_config: Any) -> dict[str, Any]:
    """The effective settings: ``store.mooncake`` overridden by a ``mooncake://`` URL.

    ``mooncake://host:port?index_url=redis%3A%2F%2Fh%3A6379%2F0&protocol=tcp&…`` names the
    master's RPC address; query options are the section's keys.
    """
    section = store_config.mooncake
    settings = {name: getattr(section, name) for name in ("master_server", *_URL_OPTIONS)}
    url = store_config.url
    if url and urlsplit(url).scheme == "mooncake":
        parts = urlsplit(url)
        if parts.netloc:
            settings["master_server"] = parts.netloc
        for name, values in parse_qs(parts.query).items():
            if name not in _URL_OPTIONS:
                raise ConfigError(f"store.url mooncake://{parts.netloc}: unknown option "
                                  f"{name!r}; known: {', '.join(_URL_OPTIONS)}")
            settings[name] = _url_value(name, values[-1], getattr(section, name))
    if not settings["master_server"]:
        raise ConfigError("store.mooncake.master_server is required for the mooncake store "
                          "(host:port of mooncake_master's RPC port), or use store.url: "
                          "mooncake://host:port")
    if not settings["index_url"]:
        raise ConfigError("store.mooncake.index_url is required: the Redis that holds the "
                          "prefix index (redis://host:6379/0, rediss://, redis+cluster://)")
    if settings["pin"] not in PINS:
        raise ConfigError(f"store.mooncake.pin must be one of {', '.join(PINS)}, got "
                          f"{settings['pin']!r}")
    if settings["protocol"] not in ("tcp", "rdma"):
        raise ConfigError(f"store.mooncake.protocol must be tcp or rdma, got "
                          f"{settings['protocol']!r}")
    return settings


def _url_value(name: str, text: str, default: Any) -> Any:
    if isinstance(default, bool):
        if text.lower() not in ("true", "false", "1", "0"):
            raise ConfigError(f"store.url option {name} must be true or false, got {text!r}")
        return text.lower() in ("true", "1")
    if isinstance(default, int):
        if not text.isdigit():
            raise ConfigError(f"store.url option {name} must be a non-negative integer, got "
                              f"{text!r}")
        return int(text)
    if isinstance(default, float):
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"store.url option {name} must be a number, got {text!r}") from None
    return text


def replicate_config(settings: dict[str, Any]) -> Any:
    """The ``ReplicateConfig`` for puts: replicas, preferred segment and pinning."""
    from mooncake.store import ReplicateConfig, SoftPinAction

    config = ReplicateConfig()
    config.replica_num = int(settings["replica_num"])
    if settings["preferred_segment"]:
        config.preferred_segment = settings["preferred_segment"]
    if settings["pin"] == "hard":
        config.with_hard_pin = True
    elif settings["pin"] == "soft":
        config.soft_pin_action = SoftPinAction.ENABLE
    else:
        config.soft_pin_action = SoftPinAction.DISABLE
    return config


def _import_client() -> Any:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise ImportError(
            f"the mooncake store needs Mooncake's Python client: pip install "
            f"'fd-routing-replay[mooncake]' (mooncake-transfer-engine-non-cuda on machines "
            f"without CUDA, which needs Debian's libibverbs1; mooncake-transfer-engine with "
            f"CUDA): {exc}") from exc
    return MooncakeDistributedStore


def _index_client(store_config: Any, index_url: str,
                  timeout_s: float | None = None) -> tuple[Any, str]:
    """A redis-py client on the index Redis, with ``store.redis``'s credentials/timeouts
    (``timeout_s`` replaces the timeout)."""
    from fd_routing_replay.store._redis import redis_client_from_config

    section = dataclasses.replace(store_config.redis, url=index_url)
    if timeout_s is not None:
        section = dataclasses.replace(section, socket_timeout_s=timeout_s)
    client, _, location = redis_client_from_config(
        dataclasses.replace(store_config, url=None, redis=section))
    return client, location


def open_mooncake_store(store_config: Any) -> MooncakeStore:
    """Factory for ``type: mooncake`` and ``mooncake://`` URLs."""
    settings = mooncake_settings(store_config)
    namespace = check_namespace(store_config.namespace)
    client_class = _import_client()
    redis_client, index_location = _index_client(store_config, settings["index_url"])
    try:
        redis_client.ping()
    except Exception as exc:
        from fd_routing_replay.store._redis import translate_error

        redis_client.close()
        raise translate_error(exc, f"the Mooncake store's index Redis {index_location} is "
                                   "unreachable") from exc
    local_host = settings["local_host"] or os.environ.get("POD_IP", "").strip() or "127.0.0.1"
    setup = {
        "local_hostname": local_host,
        "metadata_server": settings["metadata_server"],
        "global_segment_size": int(settings["global_segment_size"]),
        "local_buffer_size": int(settings["local_buffer_size"]),
        "protocol": settings["protocol"],
        "rdma_devices": settings["device"] if settings["protocol"] == "rdma" else "",
        "master_server_addr": settings["master_server"],
    }
    location = redact_url(settings["master_server"])
    client = client_class()
    try:
        code = client.setup(setup)
    except Exception as exc:  # noqa: BLE001 - reported as a store error
        redis_client.close()
        raise TransientStoreError(f"cannot start a Mooncake client (master {location}): "
                                  f"{type(exc).__name__}: {redact_text(str(exc))}") from exc
    if code != 0:
        redis_client.close()
        with contextlib.suppress(Exception):
            client.close()
        raise TransientStoreError(
            f"cannot start a Mooncake client ({settings['protocol']} on {local_host}, master "
            f"{location}, metadata {redact_url(settings['metadata_server'])}): setup returned "
            f"{code}; is mooncake_master running there, and the metadata server right? (its "
            f"log above says why)")
    store = MooncakeStore(
        client, redis_client, namespace, location=location,
        replicate_config=replicate_config(settings),
        local_buffer_size=int(settings["local_buffer_size"]),
        force_remove=bool(settings["force_remove"]), lease_wait_s=float(settings["lease_wait_s"]),
        max_batch=int(settings["max_batch"]), master_http=settings["master_http"],
        index_location=index_location, transport=f"{settings['protocol']} {local_host}",
        index_buckets=int(getattr(store_config.redis, "index_buckets", 1)))
    store.index.reload_layout()
    return store


# -- declaration -----------------------------------------------------------------------------------

_HOST_PORT = _parse.host_port_check(port_required=True, allow_empty=True)


@dataclasses.dataclass(frozen=True)
class MooncakeStoreConfig(Section):
    """Mooncake Store (mooncake_master + segments) with a Redis prefix index."""

    _path: ClassVar[str] = "store.mooncake"
    master_server: str = option("", "host:port of mooncake_master's RPC port; required for mooncake.",
                                check=_HOST_PORT)
    index_url: str = option("", "Redis URL holding the prefix index (redis://, rediss://, redis+cluster://); "
                            "required for mooncake; credentials and timeouts from store.redis.",
                            check=_parse.redis_url_check(_parse.REDIS_SCHEMES, allow_empty=True), url=True)
    metadata_server: str = option("P2PHANDSHAKE", "Transfer-engine metadata: P2PHANDSHAKE (none needed), "
                                  "http://host:port/metadata (the master's --enable_http_metadata_server) "
                                  "or etcd://host:port.", check=nonempty)
    protocol: str = option("tcp", "Transfer protocol: tcp works anywhere, rdma needs an RDMA NIC.",
                           choices=("tcp", "rdma"))
    device: str = option("", "rdma: NIC name(s), comma-separated; empty = Mooncake picks.")
    local_host: str = option("", "Address peers reach this node at; empty = $POD_IP, else 127.0.0.1.",
                             check=_parse.host_port_check(port_required=False, allow_empty=True))
    global_segment_size: int = option(0, "Memory this process contributes to the store (0 = none: records "
                                      "live in segments of dedicated holders such as mooncake_client; a "
                                      "segment's records go away with its process).", size=True, min=0)
    local_buffer_size: int = option(64 * 2**20, "Registered transfer buffer; must exceed the largest record "
                                    "+ 16 bytes.", size=True, min=2**20)
    replica_num: int = option(1, "Copies of each record, in different segments.", min=1, max=16)
    preferred_segment: str = option("", "Segment (its host:port) records are put into first; empty = any.")
    pin: str = option("hard", "hard: never evicted (a full store refuses puts); soft: evicted after "
                      "unpinned objects while the master's soft-pin TTL lasts, like them after it; "
                      "none: evictable cache.", choices=PINS)
    force_remove: bool = option(True, "Remove records a reader holds a lease on (-706); false = wait up to "
                                "lease_wait_s for the lease to lapse, then fail.")
    lease_wait_s: float = option(12.0, "force_remove false: how long a delete waits out leases.", min=0)
    max_batch: int = option(1000, "Keys per batch_remove / batch_is_exist call.", min=1, max=10000)
    master_http: str = option("", "host:port of the master's HTTP server (--metrics_port): fsck lists "
                              "objects there; empty = fsck cannot look for unindexed records.",
                              check=_HOST_PORT)


def _redis_target(store_config: Any) -> RedisTarget:
    """The index Redis, reached with ``store.redis``'s credentials."""
    url = mooncake_settings(store_config)["index_url"]
    return RedisTarget(url, lambda timeout_s: _index_client(store_config, url, timeout_s)[0])


def _rdma_check(store_config: Any, report: Any) -> tuple[str, str]:
    if mooncake_settings(store_config)["protocol"] == "tcp":
        return "ok", f"store.mooncake.protocol is tcp; {report.reason}"
    if report.tcp_only:
        return "fail", f"store.mooncake.protocol is rdma but {report.reason}; set protocol: tcp"
    return "ok", f"Mooncake will use RDMA: {report.reason}"


def check_master(store_config: Any, timeout_s: float) -> Any:
    """``fd-rr doctor``: the master answers on its RPC port; with ``master_http``, its
    ``/health`` says ok and ``/get_all_segments`` lists the segments records can go to."""
    from fd_routing_replay.doctor import FAIL, OK, WARN, Check

    settings = mooncake_settings(store_config)
    master = settings["master_server"]
    host, _, port = master.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except (OSError, ValueError) as exc:
        return Check("mooncake", FAIL, f"mooncake_master RPC port {master} does not answer: "
                                       f"{type(exc).__name__}: {exc}",
                     ["is mooncake_master running there (--rpc_port, --rpc_address)?"])
    admin = settings["master_http"]
    if not admin:
        return Check("mooncake", OK, f"mooncake_master {master} accepts connections",
                     ["set store.mooncake.master_http (the master's --metrics_port) to check "
                      "its health and segments, and to let fsck list objects"])
    try:
        with urllib.request.urlopen(f"http://{admin}/health", timeout=timeout_s) as answer:  # noqa: S310
            health = json.loads(answer.read())
        with urllib.request.urlopen(f"http://{admin}/get_all_segments",  # noqa: S310
                                    timeout=timeout_s) as answer:
            segments = [line for line in answer.read().decode().split("\n") if line]
    except (OSError, ValueError) as exc:
        return Check("mooncake", FAIL, f"mooncake_master HTTP server {admin} does not answer: "
                                       f"{type(exc).__name__}: {exc}")
    if health.get("status") != "ok":
        return Check("mooncake", FAIL, f"mooncake_master {master} is not healthy: {health}")
    summary = f"mooncake_master {master}: healthy, {len(segments)} segment(s) mounted"
    if not segments and not settings["global_segment_size"]:
        return Check("mooncake", WARN, summary, [
            "no segment is mounted and store.mooncake.global_segment_size is 0: puts will fail "
            "(-200) until a segment holder (mooncake_client) joins"])
    return Check("mooncake", OK, summary, segments[:10])


BACKEND = StoreBackend(
    name="mooncake", factory=open_mooncake_store, config_section=MooncakeStoreConfig,
    capabilities=frozenset({Capability.INDEXED, Capability.CROSS_PROCESS}),
    redis_target=_redis_target, rdma_check=_rdma_check, doctor_checks=(("mooncake", check_master),))
