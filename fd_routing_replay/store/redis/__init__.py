"""The redis backend: routing records stored in Redis itself (single node, TLS, ACL, or
Redis Cluster), one HASH per record, with the prefix-bucket index beside them and
``retention.ttl_s`` applied by Redis's own expiry.  redis-py is imported only when the
backend is opened.
"""

from __future__ import annotations

from fd_routing_replay.store.redis.factory import open_redis_store, redis_target
from fd_routing_replay.store.redis.records import DEFAULT_CHUNK_BYTES, KEY_PREFIX, payload_key
from fd_routing_replay.store.redis.store import RedisStore
from fd_routing_replay.store.redis_client import (
    redis_client_from_config,
    translate_error,
    translating_errors,
)

__all__ = ["DEFAULT_CHUNK_BYTES", "KEY_PREFIX", "RedisStore", "open_redis_store", "payload_key",
           "redis_client_from_config", "redis_target", "translate_error", "translating_errors"]
