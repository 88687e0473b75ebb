"""The mooncake store's declaration: its ``store.mooncake`` config section and catalogue entry.

Light on purpose (config loads it): the store's code, :mod:`fd_routing_replay.store.mooncake`,
is named by strings and imported only when the backend is chosen.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar
from urllib.parse import parse_qsl, urlsplit

from fd_routing_replay.config.backends import Capability, Section, StoreBackend, option
from fd_routing_replay.config.options import nonempty
from fd_routing_replay.core import parsing as _parse
from fd_routing_replay.errors import ConfigError

PINS = ("hard", "soft", "none")
"""How records are pinned against eviction (store.mooncake.pin)."""

_HOST_PORT = _parse.host_port_check(port_required=True, allow_empty=True)

@dataclasses.dataclass(frozen=True)
class MooncakeStoreConfig(Section):
    """Mooncake Store (mooncake_master + segments) with a Redis prefix index."""

    _path: ClassVar[str] = "store.mooncake"
    master_server: str = option("", "host:port of mooncake_master's RPC port; required for mooncake.",
                                check=_HOST_PORT)
    index_url: str = option("", "Redis URL holding the prefix index (redis://, rediss://, redis+cluster://); "
                            "required for mooncake; credentials and timeouts from store.redis.",
                            check=_parse.redis_url_check(_parse.REDIS_SCHEMES, allow_empty=True), url=True)
    metadata_server: str = option("P2PHANDSHAKE", "Transfer-engine metadata: P2PHANDSHAKE (none needed), "
                                  "http://host:port/metadata (the master's --enable_http_metadata_server) "
                                  "or etcd://host:port.", check=nonempty)
    protocol: str = option("tcp", "Transfer protocol: tcp works anywhere, rdma needs an RDMA NIC.",
                           choices=("tcp", "rdma"))
    device: str = option("", "rdma: NIC name(s), comma-separated; empty = Mooncake picks.")
    local_host: str = option("", "Address peers reach this node at; empty = $POD_IP, else 127.0.0.1.",
                             check=_parse.host_port_check(port_required=False, allow_empty=True))
    global_segment_size: int = option(0, "Memory this process contributes to the store (0 = none: records "
                                      "live in segments of dedicated holders such as mooncake_client; a "
                                      "segment's records go away with its process).", size=True, min=0)
    local_buffer_size: int = option(64 * 2**20, "Registered transfer buffer; must exceed the largest record "
                                    "+ 16 bytes.", size=True, min=2**20)
    replica_num: int = option(1, "Copies of each record, in different segments.", min=1, max=16)
    preferred_segment: str = option("", "Segment (its host:port) records are put into first; empty = any.")
    pin: str = option("hard", "hard: never evicted (a full store refuses puts); soft: evicted after "
                      "unpinned objects while the master's soft-pin TTL lasts, like them after it; "
                      "none: evictable cache.", choices=PINS)
    force_remove: bool = option(True, "Remove records a reader holds a lease on (-706); false = wait up to "
                                "lease_wait_s for the lease to lapse, then fail.")
    lease_wait_s: float = option(12.0, "force_remove false: how long a delete waits out leases.", min=0)
    max_batch: int = option(1000, "Keys per batch_remove / batch_is_exist call.", min=1, max=10000)
    master_http: str = option("", "host:port of the master's HTTP server (--metrics_port): fsck lists "
                              "objects there; empty = fsck cannot look for unindexed records.",
                              check=_HOST_PORT)


def mooncake_settings(store: Any) -> MooncakeStoreConfig:
    """The effective ``store.mooncake``: the section with a ``mooncake://`` URL over it, checked.

    ``mooncake://host:port?index_url=redis%3A%2F%2Fh%3A6379%2F0&protocol=tcp&…`` names the
    master's RPC address; its query may set any other key of the section, parsed and checked
    as the section declares it.
    """
    section = store.mooncake
    parts = urlsplit(store.url or "")
    if parts.scheme == "mooncake":
        values = dict(parse_qsl(parts.query, keep_blank_values=True))
        source = f"store.url mooncake://{parts.netloc}"
        if "master_server" in values:
            raise ConfigError(f"{source}: the master is the URL's host:port, not an option")
        if parts.netloc:
            values["master_server"] = parts.netloc
        section = section.overridden(values, source)
    if not section.master_server:
        raise ConfigError("store.mooncake.master_server is required for the mooncake store (host:port of "
                          "mooncake_master's RPC port), or use store.url: mooncake://host:port")
    if not section.index_url:
        raise ConfigError("store.mooncake.index_url is required: the Redis that holds the prefix index "
                          "(redis://host:6379/0, rediss://, redis+cluster://)")
    return section


def validate(config: Any) -> None:
    mooncake_settings(config.store)


BACKEND = StoreBackend(
    name="mooncake", factory="fd_routing_replay.store.mooncake:open_mooncake_store", config_section=MooncakeStoreConfig,
    capabilities=frozenset({Capability.INDEXED, Capability.CROSS_PROCESS}), validate=validate,
    redis_target="fd_routing_replay.store.mooncake.doctor:redis_target",
    rdma_check="fd_routing_replay.store.mooncake.doctor:rdma_check",
    doctor_checks=(("mooncake", "fd_routing_replay.store.mooncake.doctor:check_master"),))

