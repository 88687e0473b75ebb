"""Store registry: backend type / URL scheme -> factory.

The backends are the declarations :mod:`.backend` discovers (each backend module's
``BACKEND``, and the entry-point group ``fd_routing_replay.stores``); no list of them lives
here.  :func:`register_store` adds or replaces one in this process (tests, scripts).
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from fd_routing_replay.config.backends import ENTRY_POINT_GROUP, StoreBackend, backends
from fd_routing_replay.errors import ConfigError, UnknownStoreType
from fd_routing_replay.store.base import RoutingStore

log = logging.getLogger(__name__)

__all__ = ["ENTRY_POINT_GROUP", "StoreFactory", "backend_of", "known_store_types", "unregister_store",
           "register_store", "registered_stores", "resolve_factory", "store_type_of"]

StoreFactory = Callable[[Any], RoutingStore]

_registered: dict[str, StoreFactory | str] = {}
_lock = threading.Lock()


def register_store(name: str, factory: StoreFactory | str) -> None:
    """Register (or replace) the backend ``name``; ``factory`` may be ``"module:function"``.

    A backend registered here has no config section or doctor hooks: declare a
    :class:`~fd_routing_replay.store.backend.StoreBackend` for those.
    """
    with _lock:
        _registered[name] = factory


def unregister_store(name: str) -> bool:
    """Forget what :func:`register_store` registered as ``name`` (a declared backend of that
    name applies again); returns whether there was one."""
    with _lock:
        return _registered.pop(name, None) is not None


def registered_stores() -> dict[str, StoreFactory | str]:
    """Backends registered in this process with :func:`register_store` (the declared ones
    are found again by any process: :func:`~fd_routing_replay.store.backend.backends`)."""
    with _lock:
        return dict(_registered)


def known_store_types() -> list[str]:
    """Every type name (and URL scheme) that :func:`resolve_factory` accepts."""
    names = {name for backend in backends().values() for name in backend.names}
    with _lock:
        return sorted(names | set(_registered))


def _canonical(name: str) -> str:
    """A backend's name for one of its aliases (``rediss`` -> its backend); else ``name``."""
    if name in _registered:
        return name
    for backend in backends().values():
        if name in backend.names:
            return backend.name
    return name


def backend_of(store_config: Any) -> StoreBackend | None:
    """The declaration of the backend a store config names (None: registered by
    :func:`register_store` only, or unknown)."""
    name = store_type_of(store_config)
    with _lock:
        if name in _registered:
            return None
    return backends().get(name)


def store_type_of(store_config: Any) -> str:
    """The backend named by a store config: its URL's scheme if set, else its type."""
    if store_config.url:
        scheme = urlsplit(store_config.url).scheme
        if not scheme:
            raise ConfigError(
                f"store.url {store_config.url!r} has no scheme; expected e.g. "
                f"local:///data/rr or memory://name")
        return _canonical(scheme)
    return _canonical(store_config.type)


def resolve_factory(name: str) -> StoreFactory:
    """The factory for backend ``name``; an unknown name fails naming the known ones."""
    name = _canonical(name)
    with _lock:
        target = _registered.get(name)
    if target is None:
        backend = backends().get(name)
        if backend is None:
            raise UnknownStoreType(
                f"unknown store type {name!r}; known types: {', '.join(known_store_types())} "
                f"(third-party backends register with the entry-point group "
                f"{ENTRY_POINT_GROUP!r})")
        target = backend.factory
    if callable(target):
        return target
    module_name, _, attr = target.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except ImportError as exc:
        raise UnknownStoreType(
            f"store type {name!r} is registered ({target}) but cannot be imported: {exc}; "
            f"install its extra, e.g. pip install 'fd-routing-replay[{name}]'") from exc
