"""The configuration's typed tree: every section and key, with its type, default, doc and
check (``docs/config.md`` is generated from it); ``store.<backend>`` sections come from the
backends' light declarations (:mod:`fd_routing_replay.config.backends`)."""

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any, ClassVar

from fd_routing_replay.codec import RecordFormat
from fd_routing_replay.config.backends import ENTRY_POINT_GROUP, StoreBackend, backends
from fd_routing_replay.config.options import MAX_NESTING
from fd_routing_replay.config.options import Section as _Section
from fd_routing_replay.config.options import option as _opt
from fd_routing_replay.config.options import section as _section
from fd_routing_replay.config.stores.local import local_settings
from fd_routing_replay.core import parsing as _parse
from fd_routing_replay.core.paths import STATE_DIR_ENV, template_problem
from fd_routing_replay.errors import ConfigError
from fd_routing_replay.keys import NAMESPACE_PATTERN

__all__ = ["BACKENDS", "CONFIG_ENV_VAR", "ENV_PREFIX", "MAX_RING_BYTES", "OTHER_ENV_VARS",
           "CaptureConfig", "ResponseConfig", "RetentionConfig", "RoutingReplayConfig", "StoreConfig",
           "WriterConfig",
           "section_class"]

CONFIG_ENV_VAR = "FD_ROUTING_REPLAY_CONFIG"
ENV_PREFIX = "FD_RR_"
# The package's other FD_RR_ variables: not config keys, so not "unknown" either.
OTHER_ENV_VARS = frozenset({STATE_DIR_ENV, "FD_RR_OPS", "FD_RR_OPS_AOT_DIR", "FD_RR_OPS_CACHE", "FD_RR_OPS_JIT"})

log = logging.getLogger("fd_routing_replay.config")

#: The store backends, each with its own ``store.<name>`` section (store/backend.py).
BACKENDS: dict[str, StoreBackend] = backends()



_NAMESPACE_CHECK = _parse.pattern_check(NAMESPACE_PATTERN, f"must match {NAMESPACE_PATTERN}")


#: Upper bounds of the sizes that become memory: far above any real use, far below
#: what overflows the allocators (a typo like ``9999999TiB`` fails at load, not later).
MAX_RING_BYTES = 2**40          # 1 TiB of writer buffer


def _store_url_problem(value: str) -> str | None:
    """``store.url``: a URL with a scheme, checked further by the backend it selects."""
    problem = _parse.store_url_problem(value)
    if problem:
        return problem
    backend = next((b for b in BACKENDS.values() if value.partition("://")[0] in b.names), None)
    return backend.url_problem(value) if backend and backend.url_problem else None


@dataclass(frozen=True)
class _StoreKeys(_Section):
    """Which backend records go to; each backend's settings follow as sections."""

    _path: ClassVar[str] = "store"
    type: str = _opt("local", f"Backend: {', '.join(BACKENDS)}, or one registered under the "
                     f"{ENTRY_POINT_GROUP} entry points.", check=_parse.pattern_check(
                         r"[A-Za-z][A-Za-z0-9_.+-]*", "must be a backend name like 'local'"))
    url: str | None = _opt(None, "Store URL such as local:///data/rr (docs/stores.md lists each backend's); "
                           "when set, its scheme picks the backend instead of type.",
                           check=_store_url_problem, url=True)
    namespace: str = _opt("routing_replay", "Prefix of every stored key; clear() and prefix deletes "
                          "never leave it.", check=_NAMESPACE_CHECK)
    options: dict[str, Any] = _opt({}, "Free-form options handed to third-party backends (a later source "
                                   f"replaces the whole dict; nested at most {MAX_NESTING} levels).")
    metrics: bool = _opt(True, "Count and time every call of a store opened with open_store (readers, "
                         "the CLI) and export it to prometheus_client's default registry; false = "
                         "the bare backend.")


#: ``store``: its own keys, then one section per backend that declares one, named after it.
StoreConfig = dataclasses.make_dataclass(
    "StoreConfig",
    [(b.name, b.config_section, _section(b.config_section)) for b in BACKENDS.values()
     if b.config_section is not None],
    bases=(_StoreKeys,), frozen=True,
    namespace={"__module__": __name__, "__qualname__": "StoreConfig",
               "__doc__": "Which backend records go to, and each backend's settings."})


def __getattr__(name: str) -> Any:
    """A backend's section class by its name (``LocalStoreConfig``), as importable from here
    before the sections moved into their backend modules."""
    for backend in BACKENDS.values():
        if backend.config_section is not None and backend.config_section.__name__ == name:
            return backend.config_section
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class WriterConfig(_Section):
    """The background writer between the engine and the store."""

    _path: ClassVar[str] = "writer"
    mode: str = _opt("process", "process: store I/O in a writer process fed by shared memory; thread: in a "
                     "thread (scripts); inline: in a thread, and every submit returns once its "
                     "operation is stored, journaled or dead-lettered (tests, tools).",
                     choices=("process", "thread", "inline"))
    capacity_bytes: int = _opt(2**30, "Bytes of records that may wait for the store in the ring (shared memory) "
                               "before full_policy applies (max "
                               f"{_parse.format_size(MAX_RING_BYTES)}). Under spill and block, as many "
                               "bytes again of copies may wait for the journal: budget about twice this "
                               "of engine host memory (docs/operations.md, Capacity).", size=True, min=1,
                               max=MAX_RING_BYTES)
    full_policy: str = _opt("spill", "When full: spill to journal_dir, block then spill, or drop (counted, "
                            "logged).", choices=("spill", "block", "drop"))
    block_timeout_s: float = _opt(5.0, "How long submit_put may wait for room (full_policy block, or a "
                                  "journal that cannot keep up) before it spills, or drops the record "
                                  "(counted, logged) when the journal cannot take it either.", min=0)
    journal_dir: str = _opt("", "Where spilled records wait; replayed when the store catches up and "
                            "at start. Empty = one directory per rank, derived from the store (see "
                            "Writer directories); may hold {dp_rank} {tp_rank} {device_id} {pid} "
                            "{host} {namespace}.", check=template_problem)
    dead_letter_dir: str = _opt("", "Where records the store rejects permanently are kept, with the "
                                "reason. Empty = derived per rank like journal_dir; same placeholders.",
                                check=template_problem)
    retry_deadline_s: float = _opt(60.0, "How long transient store errors are retried before the record is "
                                   "spilled.", min=0)
    retry_initial_backoff_s: float = _opt(0.05, "First retry delay; doubles per attempt, with jitter.", gt=0)
    retry_max_backoff_s: float = _opt(5.0, "Upper bound of the retry delay.", gt=0)
    close_timeout_s: float = _opt(30.0, "How long close() and the exit hook wait for pending records.", min=0)
    metrics_port: int = _opt(0, "Port serving Prometheus metrics; 0 = not served (stats() still works).",
                             min=0, max=65535)
    metrics_addr: str = _opt("0.0.0.0", "Address the metrics port listens on: 0.0.0.0 / :: = every "
                             "interface (a Prometheus on another host), 127.0.0.1 = this host only.",
                             check=_parse.bind_address_problem)
    clear_on_start: bool = _opt(False, "Delete every record of the namespace when the writer starts.")

    def _validate(self) -> None:
        for name in ("journal_dir", "dead_letter_dir"):
            text = getattr(self, name)
            expanded = os.path.expanduser(text)
            if text and not os.path.isabs(expanded):
                absolute = os.path.abspath(expanded)
                log.info("writer.%s: relative path %r resolved against the working directory "
                         "to %s", name, text, absolute)
                object.__setattr__(self, name, absolute)
        if self.retry_initial_backoff_s > self.retry_max_backoff_s:
            raise ConfigError(f"writer.retry_initial_backoff_s ({self.retry_initial_backoff_s}) must be <= "
                              f"writer.retry_max_backoff_s ({self.retry_max_backoff_s})")


@dataclass(frozen=True)
class CaptureConfig(_Section):
    """How routing is captured and packed into records."""

    _path: ClassVar[str] = "capture"
    record_format: str = _opt(RecordFormat.RR_V1.value, "rr-v1: self-describing record; fastdeploy-raw: FastDeploy's raw "
                              "padded bytes.", choices=tuple(f.value for f in RecordFormat))
    fused: bool = _opt(True, "One record per request; false = one key per layer ({rollout_id}_{layer}).")
    pad_to_max_model_len: bool = _opt(False, "Pad records to max_model_len tokens with the fill value.")
    encoding: str = _opt("plain", "rr-v1 payload encoding: plain = the ids as captured; set = each "
                         "token-layer's top-k as a set in ceil(log2(C(num_experts, top_k) + 1)) bits, "
                         "encoded by the writer process (order inside the top-k is not kept, readers "
                         "get ascending ids; docs/record-format.md).", choices=("plain", "set"))

    prefix_omission: bool = _opt(False, "Multi-turn: when turn t-1's record is stored and its tokens "
                                 "begin turn t's, hand over only turn t's new rows; the writer "
                                 "prepends the stored ones (FastDeploy 2.6 engine side; rr-v1, fused).")
    partial_every_tokens: int = _opt(0, "Long rollouts: every this many forwarded positions, store a running "
                                     "request's routing so far as a partial record ({rollout_id}_partial, "
                                     "rr-v1), deleted once the final record is durable; an engine crash or "
                                     "abort then loses at most this many positions (docs/operations.md, "
                                     "Partial records). 0 = off.", min=0)
    weights_version: str = _opt("", "Weights version recorded in every record's provenance (wv), e.g. the "
                                "training step the rollout's weights come from; empty = not recorded.",
                                check=_parse.pattern_check(r"[^\x00-\x1f]{0,256}",
                                                           "must be at most 256 printable characters"))
    verify: bool = _opt(False, "Verification mode, for `fd-rr selftest` only: the MoE hook records a known "
                        "function of (position, layer, TP rank) instead of the routing and every record "
                        "is marked so trainer adapters refuse it; never for rollouts that train "
                        "(docs/fastdeploy.md, Self-check).")

    def _validate(self) -> None:
        if self.verify and self.record_format != RecordFormat.RR_V1:
            raise ConfigError(f"capture.verify needs rr-v1 records, whose header marks them as "
                              f"verification records; capture.record_format {self.record_format!r} "
                              "cannot carry the mark: set capture.record_format: rr-v1")
        if self.partial_every_tokens and self.record_format != RecordFormat.RR_V1:
            raise ConfigError(f"capture.partial_every_tokens ({self.partial_every_tokens}) writes rr-v1 "
                              f"partial records, whose header marks them partial; capture.record_format "
                              f"{self.record_format!r} cannot: set capture.record_format: rr-v1 or "
                              "capture.partial_every_tokens: 0")
        if self.encoding != "plain" and self.record_format != RecordFormat.RR_V1:
            raise ConfigError(f"capture.encoding {self.encoding!r} applies to rr-v1 records; "
                              f"capture.record_format {self.record_format!r} stores the ids as they "
                              "are: set capture.encoding: plain")


@dataclass(frozen=True)
class RetentionConfig(_Section):
    """Which records are kept."""

    _path: ClassVar[str] = "retention"
    only_last_turn: bool = _opt(False, "Once turn t of {base}:{t}:{s} is durable, delete turn t-1's record.")
    ttl_s: float = _opt(0.0, "Delete records created more than this many seconds ago: stores that can "
                        "expire records set the expiry at write (docs/stores.md), the writer of rank "
                        "dp0-tp0 sweeps the others and expired index entries; 0 = keep them.", min=0)
    max_bytes: int = _opt(0, "Then delete the oldest records until the namespace holds at most this many "
                          "bytes; 0 = no limit.", size=True, min=0)
    sweep_interval_s: float = _opt(300.0, "How often the writer sweeps when ttl_s or max_bytes is set.",
                                   gt=0)


@dataclass(frozen=True)
class ResponseConfig(_Section):
    """What FastDeploy 2.6's ``routing_store_type: response`` puts in each response."""

    _path: ClassVar[str] = "response"
    routes: str = _opt("payload", "FastDeploy 2.6 routing_store_type response: what routed_experts carries. "
                       "payload: the record itself (base64); reference: a small JSON reference (store "
                       "key, payload checksum and size) while the record goes to this config's store "
                       "(docs/fastdeploy.md).", choices=("payload", "reference"))
    stream: bool = _opt(False, "FastDeploy 2.6 routing_store_type response: also deliver the routes to "
                        "streaming requests, in the last chunk's metrics.routed_experts (the request "
                        "sets collect_metrics). Costs one base64 copy per finished request, streaming "
                        "or not.")


@dataclass(frozen=True)
class RoutingReplayConfig(_Section):
    """The whole configuration; build it with ``load_config``."""

    enabled: bool = _opt(False, "Capture routing; when false the engine runs a no-op recorder.")
    store: StoreConfig = _section(StoreConfig)
    writer: WriterConfig = _section(WriterConfig)
    capture: CaptureConfig = _section(CaptureConfig)
    retention: RetentionConfig = _section(RetentionConfig)
    response: ResponseConfig = _section(ResponseConfig)

    def _validate(self) -> None:
        """The checks across sections that the backend named by ``store.type`` declares."""
        if self.response.routes == "reference":
            bad = [f"capture.{name} is {str(value)!r} (set {wanted!r})" for name, value, wanted in (
                ("record_format", self.capture.record_format, RecordFormat.RR_V1.value),
                ("encoding", self.capture.encoding, "plain")) if str(value) != wanted]
            if bad:
                raise ConfigError("response.routes 'reference' pins the stored record's plain rr-v1 "
                                  f"payload, but {' and '.join(bad)}")
        if self.capture.partial_every_tokens and _fastdeploy_layout(self.store):
            raise ConfigError("capture.partial_every_tokens: the local store's fastdeploy layout holds only "
                              "FastDeploy's own files ({rollout_id}.pdtensor), not partial records "
                              "({rollout_id}_partial): use store.local.layout: tree or "
                              "capture.partial_every_tokens: 0")
        backend = _backend_of(self.store)
        if backend is not None and backend.validate is not None:
            backend.validate(self)      # on the effective section: a store.url's options included


def _backend_of(store: Any) -> Any:
    """The backend ``store`` names: its URL's scheme when set, else its type (None: unknown
    here, e.g. a third-party backend not installed; opening the store says so)."""
    name = store.url.partition("://")[0] if store.url is not None else store.type
    return next((b for b in BACKENDS.values() if name in b.names), None)


def _fastdeploy_layout(store: Any) -> bool:
    """Whether ``store`` is the local store in FastDeploy's file layout (by type or URL)."""
    return _backend_of(store) is BACKENDS["local"] and local_settings(store).layout == "fastdeploy"


def section_class(name: str) -> type:
    """A backend's section class by its name (``LocalStoreConfig``), importable from
    :mod:`fd_routing_replay.config` as before the sections moved into their declarations."""
    for backend in BACKENDS.values():
        if backend.config_section is not None and backend.config_section.__name__ == name:
            return backend.config_section
    raise AttributeError(f"module 'fd_routing_replay.config' has no attribute {name!r}")


