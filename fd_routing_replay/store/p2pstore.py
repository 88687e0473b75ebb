"""Records in P2PStore: RDMA through Mooncake, or its TCP transport where no NIC exists.

P2PStore (PyPI ``p2pstore``) keeps every payload in the memory of the process that put it
(the *provider*) and publishes ``p2p:files:{key}`` in Redis (its *metadata server*); a
reader looks the key up and pulls the bytes from the provider over RDMA or TCP.  This
backend wraps its client and guards its pitfalls (docs/stores.md, "P2PStore"):

* **Deletes are O(matched).**  Our prefix-bucket index (:mod:`.index`) lives in the same
  Redis; prefix deletes and ``clear()`` walk it and remove payloads with P2PStore's
  exact-key ``delete_batch`` (at most ``max_delete_batch`` keys a call).  Its O(N)
  ``delete_prefix*``, ``list`` and its store-wide ``clear`` are never called.
* **No key is silently dropped.**  P2PStore skips any key containing ``88888888`` (and
  still returns True).  Stored keys are ``{ns}/{key}`` with ``%`` -> ``%25`` and
  ``8`` -> ``%38``, so no stored key contains two ``8`` in a row.
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

``layout: fastdeploy`` (:mod:`.p2pstore_fastdeploy`) stores FastDeploy's own bare keys and
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
import re
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar
from urllib.parse import parse_qs, urlsplit

from fd_routing_replay import _parse
from fd_routing_replay.errors import (
    ConfigError,
    PermanentStoreError,
    ProviderUnavailableError,
    TransientStoreError,
)
from fd_routing_replay.keys import check_namespace
from fd_routing_replay.redact import redact_text, redact_url
from fd_routing_replay.store._p2p_runtime import (
    AsyncBridge,
    LogWriter,
    close_tcp_listeners,
    import_p2pstore,
    probe_provider,
    resolve_log_dir,
)
from fd_routing_replay.store._p2p_runtime import choose_transport as _choose_transport
from fd_routing_replay.store._p2p_runtime import local_host as _local_host
from fd_routing_replay.store._p2p_runtime import metadata_client as _redis_client
from fd_routing_replay.store._p2p_runtime import trusted_device as _trusted_device
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

__all__ = ["P2PStoreStore", "ProviderUnavailableError", "decode_component",
           "encode_component", "open_p2pstore_store", "p2pstore_settings", "stored_key"]

FILE_PREFIX = "p2p:files:"          # P2PStore's metadata record of one key
FILE_INDEX = "p2p:files:index"      # P2PStore's set of every key (we only SSCAN our slice)
PROVIDER_PREFIX = "p2p:providers:"  # P2PStore's registration of one transport address
DEFAULT_OP_TIMEOUT_S = 120.0
FRAME = b"fdrr-p2p" + bytes([1]) + bytes(7)
"""16 bytes before every value: P2PStore cannot carry an empty value, and a versioned
frame tells our payloads from foreign ones.  16 keeps the record's alignment."""
_ESCAPES = re.compile(r"%(25|38)")
LAYOUTS = ("tree", "fastdeploy")
"""``tree``: ``{ns}/{key}`` escaped, framed rr-v1 records; ``fastdeploy``: FastDeploy's own
bare keys and raw padded values (:mod:`.p2pstore_fastdeploy`)."""


# -- key encoding ------------------------------------------------------------------------------

def encode_component(text: str) -> str:
    """Escape ``%`` and ``8`` so the result never contains ``88``: P2PStore drops any key
    holding ``88888888``.  Injective; :func:`decode_component` inverts it."""
    return text.replace("%", "%25").replace("8", "%38")


def decode_component(text: str) -> str:
    """Invert :func:`encode_component` (one left-to-right pass)."""
    return _ESCAPES.sub(lambda m: "%" if m.group(1) == "25" else "8", text)


def stored_key(namespace: str, key: str) -> str:
    """The P2PStore key of a store key: ``{ns}/{key}``, both escaped."""
    return f"{encode_component(namespace)}/{encode_component(key)}"


# -- the store -----------------------------------------------------------------------------------

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
            pattern = _glob_escape(self._ns_prefix).encode() + b"*"
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


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


# -- factory -------------------------------------------------------------------------------------

def p2pstore_settings(store_config: Any) -> dict[str, Any]:
    """The effective P2PStore settings: ``store.p2pstore`` overridden by a ``p2pstore://`` URL.

    ``p2pstore://[user:password@]host:port/db?protocol=tcp&device=mlx5_0&local_host=…``
    names the metadata Redis (as ``redis://…``) and may override the section's keys;
    ``layout=fastdeploy&max_model_len=N`` selects FastDeploy's own keys and values.
    """
    section = store_config.p2pstore
    settings = {name: getattr(section, name) for name in
                ("metadata_server", "protocol", "device", "local_host", "log_dir",
                 "max_delete_batch")}
    settings["layout"] = getattr(section, "layout", "tree")
    settings["max_model_len"] = getattr(section, "max_model_len", None)
    url = store_config.url
    if url and urlsplit(url).scheme == "p2pstore":
        parts = urlsplit(url)
        if parts.netloc:
            settings["metadata_server"] = f"redis://{parts.netloc}{parts.path or '/0'}"
        for name, values in parse_qs(parts.query).items():
            if name not in settings or name == "metadata_server":
                raise ConfigError(f"store.url {parts.scheme}://{parts.hostname}…: unknown "
                                  f"option {name!r}; known: protocol, device, local_host, "
                                  f"log_dir, max_delete_batch, layout, max_model_len")
            settings[name] = (_positive_int(f"store.url option {name}", values[-1])
                              if name in ("max_delete_batch", "max_model_len") else values[-1])
    if settings["layout"] not in LAYOUTS:
        raise ConfigError(f"store.p2pstore.layout must be one of {', '.join(LAYOUTS)}, got "
                          f"{settings['layout']!r}")
    max_model_len = settings["max_model_len"]
    if max_model_len is not None:
        if settings["layout"] != "fastdeploy":
            raise ConfigError("store.p2pstore.max_model_len only applies to layout fastdeploy "
                              "(the tree layout stores records as they come)")
        if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) \
                or max_model_len < 1:
            raise ConfigError(f"store.p2pstore.max_model_len must be a positive integer or "
                              f"null, got {max_model_len!r}")
    if not settings["metadata_server"]:
        raise ConfigError("store.p2pstore.metadata_server is required for the p2pstore store "
                          "(a Redis URL such as redis://10.0.0.5:6379/0), or use "
                          "store.url: p2pstore://host:port/db")
    if settings["protocol"] not in ("rdma", "tcp"):
        raise ConfigError(f"store.p2pstore.protocol must be rdma or tcp, got "
                          f"{settings['protocol']!r}")
    scheme = urlsplit(settings["metadata_server"]).scheme
    if scheme not in ("redis", "redis+sentinel"):
        raise ConfigError(
            f"P2PStore cannot use a {scheme}:// metadata server ({redact_url(settings['metadata_server'])}): "
            "it supports redis:// and redis+sentinel:// (its Redis Cluster mode fails at client "
            "start and runs scripts across slots; rediss:// is not parsed)")
    return settings


def _positive_int(what: str, text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"{what} must be a positive integer, got {text!r}")
    return int(text)


def open_p2pstore_store(store_config: Any) -> P2PStoreStore:
    """Factory for ``type: p2pstore`` and ``p2pstore://`` URLs."""
    settings = p2pstore_settings(store_config)
    namespace = check_namespace(store_config.namespace)
    timeout_s = float(getattr(store_config.redis, "socket_timeout_s", 5.0))
    log_dir = resolve_log_dir(settings["log_dir"])
    module = import_p2pstore(log_dir)
    protocol, device = _choose_transport(settings["protocol"], settings["device"])
    local_host = _local_host(settings["local_host"], protocol)
    location = redact_url(settings["metadata_server"])
    with _trusted_device(protocol, device):
        try:
            p2p_config = module.P2PConfig(
                metadata_server=settings["metadata_server"], local_host=local_host,
                protocol=protocol, device=device, redis_socket_timeout=timeout_s,
                redis_socket_connect_timeout=timeout_s)
        except ValueError as exc:
            raise ConfigError(f"P2PStore rejected its config ({location}): {redact_text(str(exc))}") from exc
    if p2p_config.protocol != protocol:
        log.warning("P2P_PROTOCOL=%s in the environment overrides store.p2pstore.protocol=%s",
                    p2p_config.protocol, protocol)
    if p2p_config.redis_socket_timeout != timeout_s:
        log.warning("P2P_REDIS_SOCKET_TIMEOUT=%s in the environment overrides the %ss Redis "
                    "timeout of P2PStore's client", p2p_config.redis_socket_timeout, timeout_s)
    redis_client = _redis_client(p2p_config, timeout_s)
    try:
        redis_client.ping()
    except Exception as exc:
        from fd_routing_replay.store._redis import translate_error

        raise translate_error(exc, f"P2PStore metadata server {location} is unreachable") \
            from exc
    bridge = AsyncBridge(name=f"p2pstore-{namespace}")
    try:
        with contextlib.redirect_stdout(LogWriter()), _trusted_device(protocol, device):
            client = module.P2PClient(p2p_config)
    except Exception as exc:
        bridge.close()
        redis_client.close()
        message = (f"cannot start a P2PStore client ({protocol} on {local_host}, metadata "
                   f"{location}): {type(exc).__name__}: {redact_text(str(exc))}")
        raise TransientStoreError(message) from exc
    transport = f"{p2p_config.protocol} {client.transport.get_local_addr()}"
    if p2p_config.protocol == "rdma" and p2p_config.device:
        transport += f" device={p2p_config.device}"
    common = {"location": location, "transport": transport, "log_dir": str(log_dir),
              "max_delete_batch": settings["max_delete_batch"]}
    if settings["layout"] == "fastdeploy":
        from fd_routing_replay.store.p2pstore_fastdeploy import FastDeployP2PStore

        return FastDeployP2PStore(client, redis_client, bridge, namespace,
                                  max_model_len=settings["max_model_len"], **common)
    store = P2PStoreStore(client, redis_client, bridge, namespace, **common)
    store.index.reload_layout()  # one round trip now rather than inside the first call
    return store


# -- declaration -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class P2PStoreConfig(Section):
    """P2PStore (RDMA through Mooncake, or its TCP transport) with Redis as metadata server."""

    _path: ClassVar[str] = "store.p2pstore"
    metadata_server: str = option(
        "", "Redis URL of P2PStore's metadata server (holds our prefix index too); required for p2pstore.",
        check=_parse.redis_url_check(_parse.METADATA_SCHEMES, allow_empty=True), url=True)
    protocol: str = option("rdma", "Transfer protocol: rdma needs an RDMA NIC, tcp works anywhere.",
                           choices=("rdma", "tcp"))
    device: str = option("auto", "RDMA NIC name(s), comma-separated, or auto to pick an active port.",
                         check=_parse.pattern_check(r"auto|[A-Za-z0-9_.:-]+(,[A-Za-z0-9_.:-]+)*",
                                                    "must be 'auto' or NIC names separated by commas"))
    local_host: str = option("", "Address peers reach this node at, host or host:port; empty = $POD_IP, "
                             "else 127.0.0.1.", check=_parse.host_port_check(port_required=False,
                                                                               allow_empty=True))
    log_dir: str | None = option(None, "Directory for P2PStore's own logs (P2P_LOG_DIR); null = chosen by the "
                                 "store, never the cwd.")
    max_delete_batch: int = option(1000, "Keys per P2PStore delete_batch call (1..1000).", min=1, max=1000)
    layout: str = option("tree", "tree: rr-v1 records under escaped {namespace}/{key} keys; fastdeploy: "
                         "FastDeploy's own bare {rollout_id} / {rollout_id}_{layer} keys holding its raw padded "
                         "values (one namespace per metadata server).", choices=LAYOUTS)
    max_model_len: int | None = option(None, "layout fastdeploy: pad each record's tokens to this many, as "
                                       "FastDeploy does; null = records keep the tokens they have (the "
                                       "capture pads them to max_model_len with fastdeploy-raw).", min=1)


def _validate(config: Any) -> None:
    section = config.store.p2pstore
    if not section.metadata_server:
        raise ConfigError("store.p2pstore.metadata_server is required when store.type is "
                          "'p2pstore' (a Redis URL such as redis://10.0.0.5:6379/0; FastDeploy's "
                          "rdma_store_server)")
    if config.capture.record_format == "fastdeploy-raw" and section.layout != "fastdeploy":
        raise ConfigError("capture.record_format 'fastdeploy-raw' with P2PStore writes FastDeploy's "
                          "own bare keys: set store.p2pstore.layout: fastdeploy")


def _redis_target(store_config: Any) -> RedisTarget:
    """P2PStore's metadata server (which holds our index too)."""
    from fd_routing_replay.store._redis import client_from_url

    url = p2pstore_settings(store_config)["metadata_server"]
    return RedisTarget(url, lambda timeout_s: client_from_url(url, timeout_s))


def _rdma_check(store_config: Any, report: Any) -> tuple[str, str]:
    """Which transport P2PStore will use: RDMA on a usable NIC, else its TCP."""
    from fd_routing_replay.rdma.devices import choose_device

    settings = p2pstore_settings(store_config)
    if settings["protocol"] == "tcp":
        return "ok", f"store.p2pstore.protocol is tcp; {report.reason}"
    choice = choose_device(settings["device"], report)
    if choice.protocol == "rdma":
        return "ok", f"P2PStore will use RDMA: {choice.reason}"
    if not choice.ok and choice.candidates:
        return "fail", f"store.p2pstore.device={settings['device']!r}: {choice.reason}"
    return "warn", f"P2PStore will fall back to its TCP transport: {choice.reason}"


BACKEND = StoreBackend(
    name="p2pstore", factory=open_p2pstore_store, config_section=P2PStoreConfig,
    capabilities=frozenset({Capability.INDEXED, Capability.CROSS_PROCESS}), validate=_validate,
    fastdeploy_type="rdma", fastdeploy_keys=(("rdma_store_server", "metadata_server"),),
    redis_target=_redis_target, rdma_check=_rdma_check)
