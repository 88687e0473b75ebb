"""``fd-rr doctor`` hooks of the P2PStore backend: the Redis it depends on (its metadata
server, which holds our index too) and the transport it will pick."""

from __future__ import annotations

from typing import Any

from fd_routing_replay.config.backends import RedisTarget
from fd_routing_replay.config.stores.p2pstore import p2pstore_settings
from fd_routing_replay.core.diagnostics import FAIL, OK, WARN, Check

__all__ = ["rdma_check", "redis_target"]


def redis_target(store_config: Any) -> RedisTarget:
    """P2PStore's metadata server (which holds our index too)."""
    from fd_routing_replay.store.redis_client import client_from_url

    url = p2pstore_settings(store_config).metadata_server
    return RedisTarget(url, lambda timeout_s: client_from_url(url, timeout_s))


def rdma_check(store_config: Any, report: Any) -> Check:
    """Which transport P2PStore will use: RDMA on a usable NIC, else its TCP."""
    from fd_routing_replay.rdma.devices import choose_device

    settings = p2pstore_settings(store_config)
    if settings.protocol == "tcp":
        return Check("rdma", OK, f"store.p2pstore.protocol is tcp; {report.reason}")
    choice = choose_device(settings.device, report)
    if choice.protocol == "rdma":
        return Check("rdma", OK, f"P2PStore will use RDMA: {choice.reason}")
    if not choice.ok and choice.candidates:
        return Check("rdma", FAIL, f"store.p2pstore.device={settings.device!r}: {choice.reason}")
    return Check("rdma", WARN, f"P2PStore will fall back to its TCP transport: {choice.reason}")
