"""The catalogue of store backends: what each is called, which URL schemes and config
section it has, and where its code lives, without importing any backend's code.

Each built-in backend declares ``BACKEND = StoreBackend(...)`` in a light module of
:mod:`fd_routing_replay.config.stores` (its name, aliases, ``store.<name>`` config section,
capabilities, config checks) and names its code by ``"module:attribute"`` strings: the
factory and the doctor hooks are imported only when first called, so loading the config
loads no backend (as LMCache's adapters and vLLM's connector factory do).

Third parties add backends through the entry-point group ``fd_routing_replay.stores``: an
entry point naming a ``StoreBackend`` contributes everything above; one naming a plain
``factory(store_config)`` contributes just the factory (no section, no hooks).  A
third-party module imports :class:`StoreBackend`, :class:`Section` and :func:`option`
from :mod:`fd_routing_replay.store.backend` (the public face of this module).
"""

from __future__ import annotations

import enum
import importlib
import logging
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, fields
from importlib.metadata import entry_points
from typing import Any

from fd_routing_replay.config.options import Section, option, resolve_annotations  # noqa: F401

__all__ = ["BUILTIN_DECLARATIONS", "DECLARATION", "ENTRY_POINT_GROUP", "Capability", "LazyHook",
           "RedisTarget", "Section", "StoreBackend", "backend_named", "backends", "option"]

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "fd_routing_replay.stores"
DECLARATION = "BACKEND"
"""The module-level name under which a backend module declares its :class:`StoreBackend`."""
#: The light modules declaring the built-in backends, in the order they are listed.
BUILTIN_DECLARATIONS = tuple(f"fd_routing_replay.config.stores.{name}"
                             for name in ("local", "memory", "mooncake", "p2pstore", "redis"))
_BUILTIN_CODE = "fd_routing_replay.store."
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.+-]*")
_SECTION_NAME = re.compile(r"[a-z][a-z0-9_]*")
#: StoreConfig's own keys: no backend section may take their name.
RESERVED_SECTIONS = frozenset({"type", "url", "namespace", "options", "metrics"})


class Capability(enum.StrEnum):
    """What every store a backend opens offers beyond the required interface.

    The conformance suite (``tests/store_conformance.py``) checks a backend's stores
    against its declaration, so a declaration cannot claim more, or less, than they do.
    """

    INDEXED = "indexed"
    """An :class:`~fd_routing_replay.store.indexed.IndexedStore`: its keys are listed by a
    prefix index in Redis, so ``fd-rr fsck`` applies and ``fd-rr doctor`` samples it."""
    SLICED_READS = "sliced_reads"
    """``read_ranges(key, ranges)``: byte ranges of a record without reading all of it."""
    BATCH_READS = "batch_reads"
    """``get_many(keys)``: several records in one round trip."""
    CROSS_PROCESS = "cross_process"
    """Another process opening the same config sees the same records."""


class LazyHook:
    """A ``"module:attribute"`` reference that imports its target when first called, so a
    backend's declaration names its code without loading it."""

    __slots__ = ("target", "_resolved", "_lock")

    def __init__(self, target: str) -> None:
        module, sep, attribute = target.partition(":")
        if not (sep and module and attribute):
            raise ValueError(f"{target!r} is not a 'module:attribute' reference")
        self.target = target
        self._resolved: Callable[..., Any] | None = None
        self._lock = threading.Lock()

    def resolve(self) -> Callable[..., Any]:
        """The referenced callable (imported on first use)."""
        if self._resolved is None:
            with self._lock:
                if self._resolved is None:
                    module, _, attribute = self.target.partition(":")
                    found = getattr(importlib.import_module(module), attribute)
                    if not callable(found):
                        raise TypeError(f"{self.target} is not callable")
                    self._resolved = found
        return self._resolved

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve()(*args, **kwargs)

    def __repr__(self) -> str:
        return f"LazyHook({self.target!r})"


_HOOKS = ("validate", "url_problem", "redis_target", "rdma_check")


@dataclass(frozen=True)
class RedisTarget:
    """The Redis a store depends on, for ``fd-rr doctor``: its URL (shown redacted) and
    how to connect to it with the store's credentials, given a timeout in seconds."""

    url: str
    connect: Callable[[float], Any]


@dataclass(frozen=True)
class StoreBackend:
    """Everything the package knows about one backend, declared in the backend's module.

    ``factory(store_config) -> RoutingStore`` opens a store; it and every hook may be given
    as a ``"module:function"`` string (a :class:`LazyHook`), imported when first called, so
    the declaration stays light and heavy imports wait until the backend is chosen.  The
    hooks take the ``StoreConfig`` (``store_config``) and are all optional:

    * ``config_section`` — a frozen :class:`Section` dataclass, mounted as ``store.<name>``
      (keys, defaults, ``FD_RR_STORE__<NAME>__<KEY>`` env vars and docs come from it);
    * ``validate(config)`` — cross-section checks of the whole ``RoutingReplayConfig``
      when ``store.type`` names this backend and no ``store.url`` is set; raises
      ``ConfigError``;
    * ``url_problem(url)`` — what is wrong with a ``store.url`` of this backend's schemes
      (checked at load, naming the key), or None;
    * ``fastdeploy_type`` / ``fastdeploy_keys`` — FastDeploy's ``routing_store_type``
      that selects this backend, and its flat ``--routing-replay-config`` keys mapped to
      keys of this section;
    * ``redis_target(store_config)`` — the Redis the store depends on (its data, index or
      metadata server): ``fd-rr doctor`` pings it before opening the store;
    * ``rdma_check(store_config, device_report) -> Check`` — which transport the store will
      use (a :class:`~fd_routing_replay.core.diagnostics.Check` with status ``ok``, ``warn``
      or ``fail``); without it doctor reports RDMA as not used;
    * ``doctor_checks`` — more checks run before the store is opened, as ``(name, check)``
      pairs, ``check(store_config, timeout_s) -> Check``; a failed one (or one that raises)
      skips opening the store.
    """

    name: str
    factory: Callable[[Any], Any] | str
    aliases: tuple[str, ...] = ()
    config_section: type | None = None
    capabilities: frozenset[Capability] = frozenset()
    validate: Callable[[Any], None] | str | None = None
    url_problem: Callable[[str], str | None] | str | None = None
    fastdeploy_type: str = ""
    fastdeploy_keys: tuple[tuple[str, str], ...] = ()
    redis_target: Callable[[Any], RedisTarget] | str | None = None
    rdma_check: Callable[[Any, Any], Any] | str | None = None
    doctor_checks: tuple[tuple[str, Callable[[Any, float], Any] | str], ...] = ()

    def __post_init__(self) -> None:
        where = f"store backend {self.name!r}"
        for hook in ("factory", *_HOOKS):
            if isinstance(getattr(self, hook), str):
                object.__setattr__(self, hook, LazyHook(getattr(self, hook)))
        object.__setattr__(self, "doctor_checks", tuple(
            (name, LazyHook(check) if isinstance(check, str) else check)
            for name, check in self.doctor_checks))
        for name in (self.name, *self.aliases):
            if not isinstance(name, str) or not _NAME.fullmatch(name):
                raise ValueError(f"{where}: {name!r} is not a valid backend name or URL "
                                 f"scheme (letters, digits, _ . + -, starting with a letter)")
        known = {c.value: c for c in Capability}
        unknown = sorted(str(c) for c in self.capabilities if c not in known)
        if unknown:
            raise ValueError(f"{where}: unknown capabilities {unknown!r}; known: "
                             f"{', '.join(known)}")
        object.__setattr__(self, "capabilities", frozenset(known[c] for c in self.capabilities))
        if self.config_section is not None:
            self._check_section(where)
        if self.fastdeploy_keys and self.config_section is None:
            raise ValueError(f"{where}: fastdeploy_keys map onto its config section, which "
                             "it does not declare")
        section_keys = {f.name for f in fields(self.config_section)} if self.config_section else set()
        for flat, key in self.fastdeploy_keys:
            if key not in section_keys:
                raise ValueError(f"{where}: FastDeploy key {flat!r} maps to {key!r}, not a key "
                                 f"of its section ({', '.join(sorted(section_keys))})")

    def _check_section(self, where: str) -> None:
        section = self.config_section
        if not (isinstance(section, type) and issubclass(section, Section)
                and getattr(section, "__dataclass_params__", None) is not None
                and section.__dataclass_params__.frozen):
            raise ValueError(f"{where}: config_section must be a frozen dataclass deriving "
                             f"from fd_routing_replay.store.backend.Section, got {section!r}")
        if not _SECTION_NAME.fullmatch(self.name) or self.name in RESERVED_SECTIONS:
            raise ValueError(f"{where}: a backend with a config section needs a name usable "
                             f"as store.<name> (lower-case letters, digits, _; not one of "
                             f"{', '.join(sorted(RESERVED_SECTIONS))})")
        resolve_annotations(section)
        path = f"store.{self.name}"
        if section._path not in ("", path):
            raise ValueError(f"{where}: its section says it lives at {section._path!r}, not "
                             f"{path!r}")
        section._path = path  # messages of a directly built section name the full key

    @property
    def names(self) -> tuple[str, ...]:
        """Its name and aliases: every ``store.type`` and URL scheme selecting it."""
        return (self.name, *self.aliases)

    def has(self, capability: Capability) -> bool:
        return capability in self.capabilities


_lock = threading.RLock()
_discovered: dict[str, StoreBackend] | None = None


def backends() -> dict[str, StoreBackend]:
    """Every declared backend by name: built-ins (in module order), then entry points."""
    global _discovered
    if _discovered is None:
        with _lock:
            if _discovered is None:
                found: dict[str, StoreBackend] = {}
                for backend in _builtin_backends():
                    _add(found, backend, "fd_routing_replay.config.stores", strict=True)
                for backend, source in _entry_point_backends():
                    _add(found, backend, source, strict=False)
                _discovered = found
    return dict(_discovered)


def backend_named(name: str) -> StoreBackend | None:
    """The backend a ``store.type`` or URL scheme (name or alias) selects, or None."""
    for backend in backends().values():
        if name in backend.names:
            return backend
    return None


def _add(found: dict[str, StoreBackend], backend: StoreBackend, source: str, *,
         strict: bool) -> None:
    """Add ``backend`` unless one found earlier claims one of its names (an error for
    built-ins, a warning for entry points: a plugin cannot replace a built-in this way)."""
    taken = {name: other.name for other in found.values() for name in other.names}
    clashes = sorted(name for name in backend.names if name in taken)
    if clashes:
        message = (f"store backend {backend.name!r} ({source}) claims {', '.join(clashes)}, "
                   f"already taken by {taken[clashes[0]]!r}")
        if strict:
            raise RuntimeError(message)
        log.warning("%s: ignored (replace a backend with "
                    "fd_routing_replay.store.register_store)", message)
        return
    found[backend.name] = backend


def _builtin_backends() -> list[StoreBackend]:
    found = []
    for name in BUILTIN_DECLARATIONS:
        declared = getattr(importlib.import_module(name), DECLARATION)
        if not isinstance(declared, StoreBackend):
            raise TypeError(f"{name}.{DECLARATION} is not a StoreBackend")
        found.append(declared)
    return found


def _entry_point_backends() -> list[tuple[StoreBackend, str]]:
    found = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        source = f"entry point {ep.name} = {ep.value}"
        if ep.value.startswith(_BUILTIN_CODE):
            continue  # older installs of this package declared their built-ins here
        try:
            found.append((_entry_point_backend(ep, source), source))
        except ValueError as exc:
            log.warning("%s ignored: %s", source, exc)
    return found


def _entry_point_backend(ep: Any, source: str) -> StoreBackend:
    try:
        target = ep.load()
    except Exception as exc:  # noqa: BLE001 - one broken plugin must not break the config
        log.warning("%s cannot be loaded (%s: %s); opening that store will fail",
                    source, type(exc).__name__, exc)
        return StoreBackend(name=ep.name, factory=ep.value)
    if isinstance(target, StoreBackend):
        return target
    if callable(target):
        return StoreBackend(name=ep.name, factory=target)
    raise ValueError("neither a StoreBackend nor a factory")
