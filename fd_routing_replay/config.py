"""Typed configuration: one dataclass tree, loaded from defaults, a file, env and a dict.

Every key's type, default and one-line doc live in exactly one place, the ``_opt(...)``
call that declares it below — or, for a ``store.<backend>`` section, the ``option(...)``
call in the backend's own module (its ``StoreBackend`` declaration, found by
:func:`fd_routing_replay.store.backend.backends`); validation, environment parsing and
``docs/config.md`` are all derived from that declaration, so they cannot drift apart.

Precedence, lowest first: built-in defaults < YAML/JSON file (``path`` argument, else the
file named by ``FD_ROUTING_REPLAY_CONFIG``) < ``FD_RR_<SECTION>__<KEY>`` environment
variables < the explicit ``overrides`` dict.  A file or dict may also be FastDeploy's flat
``--routing-replay-config`` JSON; it is recognised by its keys and mapped onto the tree.
Nothing is silently ignored: unknown keys, wrong types and bad values raise
``ConfigError`` naming the dotted key, the value and the source it came from.
"""

import copy
import dataclasses
import difflib
import json
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import MISSING, Field, dataclass, fields
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import yaml

from fd_routing_replay import _parse
from fd_routing_replay.config_fields import MAX_NESTING
from fd_routing_replay.config_fields import Section as _Section
from fd_routing_replay.config_fields import annotation as _annotation
from fd_routing_replay.config_fields import coerce as _coerce
from fd_routing_replay.config_fields import config_error as _error
from fd_routing_replay.config_fields import join as _join
from fd_routing_replay.config_fields import option as _opt
from fd_routing_replay.config_fields import section as _section
from fd_routing_replay.config_fields import shown as _shown
from fd_routing_replay.config_fields import type_name as _type_name
from fd_routing_replay.errors import ConfigError
from fd_routing_replay.keys import NAMESPACE_PATTERN
from fd_routing_replay.redact import MASK, redact_url, redact_value
from fd_routing_replay.store.backend import ENTRY_POINT_GROUP, StoreBackend, backends
from fd_routing_replay.writing.directories import STATE_DIR_ENV, template_problem

__all__ = [
    "CONFIG_ENV_VAR", "ENV_PREFIX", "OTHER_ENV_VARS", "CaptureConfig", "ConfigField",
    "RetentionConfig", "RoutingReplayConfig", "StoreConfig", "WriterConfig", "config_from_dict",
    "config_from_fastdeploy", "config_to_dict", "env_var_name", "is_fastdeploy_flat",
    "iter_fields", "load_config", "render_config_doc",
]

CONFIG_ENV_VAR = "FD_ROUTING_REPLAY_CONFIG"
ENV_PREFIX = "FD_RR_"
# The package's other FD_RR_ variables: not config keys, so not "unknown" either.
OTHER_ENV_VARS = frozenset({STATE_DIR_ENV, "FD_RR_OPS", "FD_RR_OPS_AOT_DIR", "FD_RR_OPS_CACHE",
                            "FD_RR_OPS_JIT", "FD_RR_OPS_THREADS"})

log = logging.getLogger("fd_routing_replay.config")

#: The store backends, each with its own ``store.<name>`` section (store/backend.py).
_BACKENDS: dict[str, StoreBackend] = backends()


def _fastdeploy_keys() -> dict[str, str]:
    """FastDeploy's flat --routing-replay-config keys and where each lands in the tree;
    the store keys come from the backends that declare them."""
    store_keys = {flat: f"store.{backend.name}.{key}" for backend in _BACKENDS.values()
                  for flat, key in backend.fastdeploy_keys}
    return {"enable_routing_replay": "enabled", "routing_store_type": "store.type",
            **store_keys, "only_last_turn": "retention.only_last_turn",
            "use_fused_put": "capture.fused"}


_FASTDEPLOY_KEYS: dict[str, str] = _fastdeploy_keys()
#: FastDeploy's routing_store_type values and the backend each selects.
_FASTDEPLOY_STORE_TYPES = {backend.fastdeploy_type: backend.name for backend in _BACKENDS.values()
                           if backend.fastdeploy_type}


_NAMESPACE_CHECK = _parse.pattern_check(NAMESPACE_PATTERN, f"must match {NAMESPACE_PATTERN}")


#: Upper bounds of the sizes that become memory: far above any real use, far below
#: what overflows the allocators (a typo like ``9999999TiB`` fails at load, not later).
MAX_RING_BYTES = 2**40          # 1 TiB of writer buffer


def _store_url_problem(value: str) -> str | None:
    """``store.url``: a URL with a scheme, checked further by the backend it selects."""
    problem = _parse.store_url_problem(value)
    if problem:
        return problem
    backend = next((b for b in _BACKENDS.values() if value.partition("://")[0] in b.names), None)
    return backend.url_problem(value) if backend and backend.url_problem else None


@dataclass(frozen=True)
class _StoreKeys(_Section):
    """Which backend records go to; each backend's settings follow as sections."""

    _path: ClassVar[str] = "store"
    type: str = _opt("local", f"Backend: {', '.join(_BACKENDS)}, or one registered under the "
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
    [(b.name, b.config_section, _section(b.config_section)) for b in _BACKENDS.values()
     if b.config_section is not None],
    bases=(_StoreKeys,), frozen=True,
    namespace={"__module__": __name__, "__qualname__": "StoreConfig",
               "__doc__": "Which backend records go to, and each backend's settings."})


def __getattr__(name: str) -> Any:
    """A backend's section class by its name (``LocalStoreConfig``), as importable from here
    before the sections moved into their backend modules."""
    for backend in _BACKENDS.values():
        if backend.config_section is not None and backend.config_section.__name__ == name:
            return backend.config_section
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class WriterConfig(_Section):
    """The background writer between the engine and the store."""

    _path: ClassVar[str] = "writer"
    mode: str = _opt("process", "process: store I/O in a writer process fed by shared memory; thread: in a "
                     "thread (tests, scripts).", choices=("process", "thread"))
    capacity_bytes: int = _opt(2**30, "Bytes of records that may wait for the store before full_policy applies "
                               f"(max {_parse.format_size(MAX_RING_BYTES)}).", size=True, min=1,
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
    record_format: str = _opt("rr-v1", "rr-v1: self-describing record; fastdeploy-raw: FastDeploy's raw "
                              "padded bytes.", choices=("rr-v1", "fastdeploy-raw"))
    fused: bool = _opt(True, "One record per request; false = one key per layer ({rollout_id}_{layer}).")
    pad_to_max_model_len: bool = _opt(False, "Pad records to max_model_len tokens with the fill value.")
    encoding: str = _opt("plain", "rr-v1 payload encoding: plain = the ids as captured; set = each "
                         "token-layer's top-k as a set in ceil(log2(C(num_experts, top_k) + 1)) bits, "
                         "encoded by the writer process (order inside the top-k is not kept, readers "
                         "get ascending ids; docs/record-format.md).", choices=("plain", "set"))

    prefix_omission: bool = _opt(False, "Multi-turn: when turn t-1's record is stored and its tokens "
                                 "begin turn t's, hand over only turn t's new rows; the writer "
                                 "prepends the stored ones (FastDeploy 2.6 engine side; rr-v1, fused).")
    weights_version: str = _opt("", "Weights version recorded in every record's provenance (wv), e.g. the "
                                "training step the rollout's weights come from; empty = not recorded.",
                                check=_parse.pattern_check(r"[^\x00-\x1f]{0,256}",
                                                           "must be at most 256 printable characters"))

    def _validate(self) -> None:
        if self.encoding != "plain" and self.record_format != "rr-v1":
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
class RoutingReplayConfig(_Section):
    """The whole configuration; build it with ``load_config``."""

    enabled: bool = _opt(False, "Capture routing; when false the engine runs a no-op recorder.")
    store: StoreConfig = _section(StoreConfig)
    writer: WriterConfig = _section(WriterConfig)
    capture: CaptureConfig = _section(CaptureConfig)
    retention: RetentionConfig = _section(RetentionConfig)

    def _validate(self) -> None:
        """The checks across sections that the backend named by ``store.type`` declares."""
        backend = _BACKENDS.get(self.store.type)
        if self.store.url is None and backend is not None and backend.validate is not None:
            backend.validate(self)


def _from_env_text(f: Field, text: str, path: str, source: str) -> Any:
    """Turn an environment variable's text into a value of the field's type."""
    base, optional = _annotation(f)
    try:
        if optional and text == "":
            return None
        if f.metadata.get("size"):
            return _parse.parse_size(text)
        if base is bool:
            return _parse.parse_bool(text)
        if base is int:
            return _parse.parse_int(text)
        if base is float:
            return _parse.parse_float(text)
        if base is dict:
            parsed = json.loads(text)
            if not isinstance(parsed, dict):
                raise ValueError(f"expected a JSON object, got {_shown(text)}")
            return parsed
    except RecursionError:
        raise _error(path, source, f"nests more than {MAX_NESTING} levels of lists and "
                                   "mappings") from None
    except ValueError as exc:
        raise _error(path, source, str(exc)) from None
    return text


def _iter_leaves(cls: type, prefix: str) -> Iterator[tuple[str, Field]]:
    for f in fields(cls):
        path = _join(prefix, f.name)
        if f.metadata.get("section"):
            yield from _iter_leaves(f.type, path)
        else:
            yield path, f


_LEAVES: dict[str, Field] = dict(_iter_leaves(RoutingReplayConfig, ""))


def env_var_name(path: str) -> str:
    """The env var overriding a dotted key: ``store.local.root`` -> ``FD_RR_STORE__LOCAL__ROOT``."""
    return ENV_PREFIX + "__".join(part.upper() for part in path.split("."))


_ENV_NAMES: dict[str, str] = {env_var_name(path): path for path in _LEAVES}


class ConfigField(NamedTuple):
    """One documented key: dotted path, type name, default value and one-line doc."""

    path: str
    type: str
    default: Any
    doc: str

    @property
    def env_var(self) -> str:
        return env_var_name(self.path)


def iter_fields() -> Iterator[ConfigField]:
    """Yield every key of the tree in declaration order (used to generate docs/config.md)."""
    for path, f in _LEAVES.items():
        default = f.default_factory() if f.default is MISSING else f.default  # type: ignore[misc]
        yield ConfigField(path, _type_name(f), default, f.metadata["doc"])


def is_fastdeploy_flat(data: Mapping[str, Any]) -> bool:
    """True when a mapping is FastDeploy's flat ``--routing-replay-config`` form."""
    return any(key in _FASTDEPLOY_KEYS for key in data)


def _suggest(key: str, candidates: list[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    return f"; did you mean {_join(prefix, close[0])!r}?" if close else ""


def _fastdeploy_pairs(flat: Mapping[str, Any], source: str) -> Iterator[tuple[str, Any, str]]:
    """Yield (tree path, value, flat key) for each set key of a FastDeploy flat dict."""
    if not isinstance(flat, Mapping):
        raise ConfigError(
            f"FastDeploy routing-replay config must be a JSON object, got {_shown(flat)} (from {source})"
        )
    known = list(_FASTDEPLOY_KEYS)
    for key, value in flat.items():
        if key not in _FASTDEPLOY_KEYS:
            hint = _suggest(str(key), known)
            if key in {f.name for f in fields(RoutingReplayConfig)}:
                hint = "; nested keys cannot be mixed with FastDeploy's flat keys in one mapping"
            raise ConfigError(
                f"unknown FastDeploy routing-replay key {key!r} (from {source}){hint}; "
                f"known flat keys: {', '.join(known)}"
            )
        if value is None or value == "None":  # FastDeploy's spelling of "not set"
            continue
        if key == "routing_store_type":
            if value not in _FASTDEPLOY_STORE_TYPES:
                raise ConfigError(
                    f"routing_store_type (store.type): invalid value {_shown(value)}; allowed: "
                    f"'local', 'rdma' (from {source})"
                )
            value = _FASTDEPLOY_STORE_TYPES[value]
        yield _FASTDEPLOY_KEYS[key], value, key


def config_from_fastdeploy(
    flat: Mapping[str, Any], *, source: str = "FastDeploy config"
) -> dict[str, Any]:
    """Map FastDeploy's flat ``--routing-replay-config`` dict onto a nested config dict.

    Keys whose value is the string ``"None"`` (or null) count as not set, as in
    FastDeploy; every other key must be one of FastDeploy's six.  Values are checked
    when the result is loaded.
    """
    nested: dict[str, Any] = {}
    for path, value, _ in _fastdeploy_pairs(flat, source):
        node = nested
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return nested


def _walk(
    data: Mapping[Any, Any], cls: type, prefix: str, source: str, out: dict[str, tuple[Any, str]]
) -> None:
    by_name = {f.name: f for f in fields(cls)}
    for key, value in data.items():
        if not isinstance(key, str):
            raise _error(_join(prefix, _shown(key)), source, "keys must be strings")
        f = by_name.get(key)
        path = _join(prefix, key)
        if f is None:
            hint = _suggest(key, list(by_name), prefix)
            if not hint:
                elsewhere = [p for p in _LEAVES if p.rsplit(".", 1)[-1] == key]
                hint = f"; did you mean {elsewhere[0]!r}?" if elsewhere else ""
            raise _error(path, source, f"unknown key{hint} (valid keys here: {', '.join(by_name)})")
        if f.metadata.get("section"):
            if value is None:  # a section whose keys are all commented out
                continue
            if not isinstance(value, Mapping):
                raise _error(path, source, f"is a section and needs a mapping of keys, got {_shown(value)}")
            _walk(value, f.type, path, source, out)
        else:
            out[path] = (_coerce(f, value, path, source), source)


def _layer_from_mapping(data: Any, source: str) -> dict[str, tuple[Any, str]]:
    """Validate one dict source (nested or FastDeploy flat) into {dotted path: (value, source)}."""
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"configuration must be a mapping of keys, got {type(data).__name__} (from {source})"
        )
    out: dict[str, tuple[Any, str]] = {}
    if is_fastdeploy_flat(data):
        for path, value, key in _fastdeploy_pairs(data, source):
            where = f"{source}, FastDeploy key {key!r}"
            out[path] = (_coerce(_LEAVES[path], value, path, where), where)
    else:
        _walk(data, RoutingReplayConfig, "", source, out)
    return out


def _env_layer(env: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    out: dict[str, tuple[Any, str]] = {}
    for name in sorted(env):
        if not name.startswith(ENV_PREFIX) or name in OTHER_ENV_VARS:
            continue
        source = f"environment variable {name}"
        path = _ENV_NAMES.get(name)
        if path is None:
            raise ConfigError(f"unknown environment variable {name}{_suggest(name, list(_ENV_NAMES))}")
        f = _LEAVES[path]
        out[path] = (_coerce(f, _from_env_text(f, env[name], path, source), path, source), source)
    return out


def _read_file(path: str | os.PathLike[str], named_by: str | None) -> tuple[Any, str]:
    file_path = Path(path)
    named = f" (named by {named_by})" if named_by else ""
    source = f"file {file_path}{named}"
    try:
        text = file_path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {file_path}{named}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {file_path}: {exc}") from None
    try:
        if file_path.suffix.lower() == ".json":
            data = _parse.load_json_text(text)
        else:
            data = _parse.load_yaml_text(text)
    except (ValueError, yaml.YAMLError) as exc:
        kind = "JSON" if file_path.suffix.lower() == ".json" else "YAML"
        raise ConfigError(f"invalid {kind} in config file {file_path}: {exc}") from None
    except RecursionError:
        raise ConfigError(f"config file {file_path}: lists or mappings nest too deeply to parse; "
                          f"a config has at most 3 levels of sections, and store.options at most "
                          f"{MAX_NESTING} levels") from None
    return ({} if data is None else data), source


def _build(cls: type, values: Mapping[str, tuple[Any, str]], prefix: str) -> Any:
    kwargs = {}
    for f in fields(cls):
        path = _join(prefix, f.name)
        if f.metadata.get("section"):
            kwargs[f.name] = _build(f.type, values, path)
        elif path in values:
            kwargs[f.name] = values[path][0]
    return cls(**kwargs)


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    *,
    env: Mapping[str, str] | None = None,
) -> RoutingReplayConfig:
    """Build the effective configuration from defaults, a file, the environment and a dict.

    ``path`` names a YAML (or ``.json``) file; without it the file named by
    ``FD_ROUTING_REPLAY_CONFIG`` in ``env`` is used, if any.  ``env`` defaults to
    ``os.environ``; pass a dict to make loading independent of the process environment.
    ``overrides`` is a nested dict (or FastDeploy's flat form) applied last.
    """
    env = os.environ if env is None else env
    values: dict[str, tuple[Any, str]] = {}
    named_by = None
    if path is None and env.get(CONFIG_ENV_VAR, ""):
        path, named_by = env[CONFIG_ENV_VAR], CONFIG_ENV_VAR
    if path is not None:
        data, source = _read_file(path, named_by)
        values.update(_layer_from_mapping(data, source))
    values.update(_env_layer(env))
    if overrides is not None:
        values.update(_layer_from_mapping(overrides, "overrides"))
    return _build(RoutingReplayConfig, values, "")


def config_from_dict(data: Mapping[str, Any], *, source: str = "dict") -> RoutingReplayConfig:
    """Validate a nested (or FastDeploy flat) dict alone: no file, no environment.

    The inverse of ``config_to_dict``; use it to hand a config to another process
    without pickling.
    """
    return _build(RoutingReplayConfig, _layer_from_mapping(data, source), "")


def config_to_dict(cfg: Any, *, redact: bool = False) -> dict[str, Any]:
    """Return a config (or one section) as a nested dict of plain values.

    With ``redact=True`` the result can be printed or logged: secret values (passwords)
    become ``"***"``, and so do passwords inside URLs and inside ``store.options``
    (see :mod:`fd_routing_replay.redact`).
    """
    result: dict[str, Any] = {}
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if f.metadata.get("section"):
            result[f.name] = config_to_dict(value, redact=redact)
        elif redact and f.metadata.get("secret") and value is not None:
            result[f.name] = MASK
        elif redact and f.metadata.get("url") and isinstance(value, str):
            result[f.name] = redact_url(value)
        elif redact:
            result[f.name] = redact_value(copy.deepcopy(value))
        else:
            result[f.name] = copy.deepcopy(value)
    return result


def render_config_doc() -> str:
    """Render the key table of docs/config.md from the dataclass tree."""
    lines = [
        "| Key | Type | Default | Environment variable | Description |",
        "|---|---|---|---|---|",
    ]
    for item in iter_fields():
        is_size = _LEAVES[item.path].metadata.get("size")
        default = _parse.format_size(item.default) if is_size else json.dumps(item.default)
        doc = item.doc.replace("|", "\\|")
        lines.append(f"| `{item.path}` | {item.type} | `{default}` | `{item.env_var}` | {doc} |")
    return "\n".join(lines) + "\n"
