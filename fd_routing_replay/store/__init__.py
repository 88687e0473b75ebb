"""Pluggable routing stores: the interface, the registry and :func:`open_store`."""

from __future__ import annotations

from typing import Any

from fd_routing_replay.store.base import RoutingStore
from fd_routing_replay.store.registry import (
    known_store_types,
    register_store,
    resolve_factory,
    store_type_of,
)

__all__ = ["RoutingStore", "open_store", "register_store", "known_store_types",
           "store_config_from"]


def store_config_from(config_or_url: Any, namespace: str | None = None) -> Any:
    """Normalise a URL, a type name, a dict, a full config or a store config section."""
    from fd_routing_replay.config import RoutingReplayConfig, StoreConfig, config_from_dict

    if isinstance(config_or_url, RoutingReplayConfig):
        store_config = config_or_url.store
    elif isinstance(config_or_url, StoreConfig):
        store_config = config_or_url
    elif isinstance(config_or_url, str):
        key = "url" if "://" in config_or_url else "type"
        store_config = config_from_dict({"store": {key: config_or_url}}, source="open_store").store
    elif isinstance(config_or_url, dict):
        store_config = config_from_dict({"store": config_or_url}, source="open_store").store
    else:
        raise TypeError(
            "open_store() takes a store URL, a type name, a dict, a RoutingReplayConfig or "
            f"a StoreConfig, not {type(config_or_url).__name__}")
    if namespace is not None and namespace != store_config.namespace:
        from dataclasses import replace

        store_config = replace(store_config, namespace=namespace)
    return store_config


def open_store(config_or_url: Any, namespace: str | None = None) -> RoutingStore:
    """Open the store a config (or ``scheme://`` URL, or type name) describes."""
    store_config = store_config_from(config_or_url, namespace)
    factory = resolve_factory(store_type_of(store_config))
    return factory(store_config)
