"""The redis store's declaration: its ``store.redis`` config section and catalogue entry.

Light on purpose (config loads it): the store's code, :mod:`fd_routing_replay.store.redis`,
is named by strings and imported only when the backend is chosen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fd_routing_replay.config.backends import Capability, Section, StoreBackend, option
from fd_routing_replay.core import parsing as _parse


@dataclass(frozen=True)
class RedisStoreConfig(Section):
    """Records stored in Redis itself, with the prefix-bucket index beside them."""

    _path: ClassVar[str] = "store.redis"
    url: str = option("redis://127.0.0.1:6379/0", "Redis server URL: redis://host:port/db, rediss:// for TLS, "
                      "redis+cluster:// for a cluster.", check=_parse.redis_url_check(_parse.REDIS_SCHEMES),
                      url=True)
    username: str | None = option(None, "ACL user name; overrides one given in the URL.")
    password: str | None = option(None, "ACL password; prefer the env var FD_RR_STORE__REDIS__PASSWORD to a "
                                  "file.", secret=True)
    ssl_ca_certs: str | None = option(None, "CA bundle to verify the server with rediss://; null = system CAs.")
    cluster: bool = option(False, "Talk to a Redis Cluster; url names any one node.")
    chunk_bytes: int = option(2**20, "Records larger than this are stored in chunks of this size (max "
                              "512MiB); a sliced read fetches the chunks holding its bytes.", size=True,
                              min=1, max=512 * 2**20)
    index_buckets: int = option(1, "Sorted sets (buckets) the prefix index of a namespace is spread over, by a "
                                "hash of the rollout base, one cluster hash tag each (redis and mooncake "
                                "stores); 1 = one set. The count recorded in Redis wins; `fd-rr fsck "
                                "--migrate-index` moves entries to this count.", min=1, max=256)
    socket_timeout_s: float = option(5.0, "Timeout of each Redis connect and command, in seconds.", gt=0)


BACKEND = StoreBackend(
    name="redis", aliases=("rediss", "redis+cluster"),
    factory="fd_routing_replay.store.redis.factory:open_redis_store",
    config_section=RedisStoreConfig,
    capabilities=frozenset({Capability.INDEXED, Capability.SLICED_READS, Capability.BATCH_READS,
                            Capability.CROSS_PROCESS}),
    redis_target="fd_routing_replay.store.redis.factory:redis_target")

