"""The redis backend's entry points, named by its declaration
(:mod:`fd_routing_replay.config.stores.redis`): the factory that opens a
:class:`~fd_routing_replay.store.redis.store.RedisStore` from a store config, and the
``redis_target`` hook ``fd-rr doctor`` uses to reach the store's Redis.  redis-py itself is
imported by :mod:`fd_routing_replay.store.redis_client`, inside these calls.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any
from urllib.parse import urlsplit

from fd_routing_replay.config.backends import RedisTarget
from fd_routing_replay.store.redis.store import RedisStore
from fd_routing_replay.store.redis_client import redis_client_from_config

__all__ = ["open_redis_store", "redis_target"]

log = logging.getLogger("fd_routing_replay.store.redis")


def open_redis_store(store_config: Any) -> RedisStore:
    """Factory for ``type: redis`` and ``redis://``, ``rediss://``, ``redis+cluster://``."""
    client, cluster, location = redis_client_from_config(store_config)
    store = RedisStore(client, store_config.namespace, chunk_bytes=store_config.redis.chunk_bytes,
                       cluster=cluster, location=location,
                       index_buckets=store_config.redis.index_buckets)
    try:  # read the index layout now; if Redis is down, the first call reads it (and fails)
        store.index.reload_layout()
    except Exception as exc:  # noqa: BLE001 - reported by the first operation instead
        log.debug("%s: index layout not read at open: %s", store.describe(), exc)
    return store


def redis_target(store_config: Any) -> RedisTarget:
    """The store's own Redis (``store.url`` when it names Redis, else ``store.redis.url``)."""
    url = store_config.url or store_config.redis.url
    url = url if urlsplit(url).scheme.startswith("redis") else store_config.redis.url

    def connect(timeout_s: float) -> Any:
        section = replace(store_config.redis, socket_timeout_s=timeout_s)
        return redis_client_from_config(replace(store_config, redis=section))[0]

    return RedisTarget(url, connect)
