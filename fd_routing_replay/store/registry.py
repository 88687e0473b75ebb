"""Store registry: backend type / URL scheme -> factory.

Built-in backends are named by import path so their optional dependencies load only when
used.  Third-party packages add backends through the entry-point group
``fd_routing_replay.stores`` (name = type or scheme, value = ``factory(store_config)``).
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any
from urllib.parse import urlsplit

from fd_routing_replay.errors import ConfigError, UnknownStoreType
from fd_routing_replay.store.base import RoutingStore

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "fd_routing_replay.stores"
StoreFactory = Callable[[Any], RoutingStore]

_BUILTIN: dict[str, str] = {
    "memory": "fd_routing_replay.store.memory:open_memory_store",
    "local": "fd_routing_replay.store.local:open_local_store",
    "redis": "fd_routing_replay.store.redis_store:open_redis_store",
    "p2pstore": "fd_routing_replay.store.p2pstore:open_p2pstore_store",
    "mooncake": "fd_routing_replay.store.mooncake:open_mooncake_store",
}
# URL schemes that name another backend.
_ALIASES = {"file": "local", "rediss": "redis", "redis+cluster": "redis"}

_registered: dict[str, StoreFactory | str] = {}
_lock = threading.Lock()
_entry_points_loaded = False


def register_store(name: str, factory: StoreFactory | str) -> None:
    """Register (or replace) the backend ``name``; ``factory`` may be ``"module:function"``."""
    with _lock:
        _registered[name] = factory


def registered_stores() -> dict[str, StoreFactory | str]:
    """Backends registered in this process with :func:`register_store` or entry points."""
    _load_entry_points()
    with _lock:
        return dict(_registered)


def known_store_types() -> list[str]:
    """Every type name that :func:`resolve_factory` accepts."""
    _load_entry_points()
    return sorted(set(_BUILTIN) | set(_registered) | set(_ALIASES))


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    with _lock:
        if _entry_points_loaded:
            return
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            # Our own package declares its built-ins too; an explicit registration wins.
            _registered.setdefault(ep.name, ep.value)
        _entry_points_loaded = True


def store_type_of(store_config: Any) -> str:
    """The backend named by a store config: its URL's scheme if set, else its type."""
    if store_config.url:
        scheme = urlsplit(store_config.url).scheme
        if not scheme:
            raise ConfigError(
                f"store.url {store_config.url!r} has no scheme; expected e.g. "
                f"local:///data/rr, memory://, redis://host:6379/0")
        return _ALIASES.get(scheme, scheme)
    return _ALIASES.get(store_config.type, store_config.type)


def resolve_factory(name: str) -> StoreFactory:
    """The factory for backend ``name``; an unknown name fails naming the known ones."""
    _load_entry_points()
    name = _ALIASES.get(name, name)
    target = _registered.get(name) or _BUILTIN.get(name)
    if target is None:
        raise UnknownStoreType(
            f"unknown store type {name!r}; known types: {', '.join(known_store_types())} "
            f"(third-party backends register with the entry-point group {ENTRY_POINT_GROUP!r})")
    if callable(target):
        return target
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UnknownStoreType(
            f"store type {name!r} is registered ({target}) but cannot be imported: {exc}; "
            f"install its extra, e.g. pip install 'fd-routing-replay[{name}]'") from exc
    return getattr(module, attr)
