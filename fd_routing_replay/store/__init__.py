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


def open_store(config_or_url: Any, namespace: str | None = None, *,
               instrument: bool | None = None, metrics_registry: Any = None,
               rank: str = "") -> RoutingStore:
    """Open the store a config (or ``scheme://`` URL, or type name) describes.

    The store comes wrapped in an :class:`~fd_routing_replay.store.instrumented.InstrumentedStore`
    that counts and times every call, exported (labels: namespace, backend, ``rank``) to
    ``metrics_registry`` or ``prometheus_client``'s default registry, so a trainer serving
    that registry reports its reads.  ``instrument=False`` (or ``store.metrics: false``)
    returns the bare backend.
    """
    store_config = store_config_from(config_or_url, namespace)
    store_type = store_type_of(store_config)
    store = resolve_factory(store_type)(store_config)
    if not (store_config.metrics if instrument is None else instrument):
        return store
    from fd_routing_replay.metrics import labels_for
    from fd_routing_replay.store.instrumented import InstrumentedStore
    from fd_routing_replay.store.metrics import store_metrics_for

    labels = labels_for(store_config.namespace, store_type, rank)
    return InstrumentedStore(store, store_metrics_for(labels, metrics_registry))
