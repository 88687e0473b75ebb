"""The clients the Mooncake backend builds: Mooncake's own (imported only here, when a
store opens), its ``ReplicateConfig``, and the redis-py client on the index Redis."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["import_client", "index_client", "replicate_config"]


def replicate_config(settings: Any) -> Any:
    """The ``ReplicateConfig`` for puts: replicas, preferred segment and pinning."""
    from mooncake.store import ReplicateConfig, SoftPinAction

    config = ReplicateConfig()
    config.replica_num = int(settings.replica_num)
    if settings.preferred_segment:
        config.preferred_segment = settings.preferred_segment
    if settings.pin == "hard":
        config.with_hard_pin = True
    elif settings.pin == "soft":
        config.soft_pin_action = SoftPinAction.ENABLE
    else:
        config.soft_pin_action = SoftPinAction.DISABLE
    return config


def import_client() -> Any:
    """Mooncake's ``MooncakeDistributedStore`` class; an ImportError says what to install."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise ImportError(
            f"the mooncake store needs Mooncake's Python client: pip install "
            f"'fd-routing-replay[mooncake]' (mooncake-transfer-engine-non-cuda on machines "
            f"without CUDA, which needs Debian's libibverbs1; mooncake-transfer-engine with "
            f"CUDA): {exc}") from exc
    return MooncakeDistributedStore


def index_client(store_config: Any, index_url: str,
                 timeout_s: float | None = None) -> tuple[Any, str]:
    """A redis-py client on the index Redis, with ``store.redis``'s credentials/timeouts
    (``timeout_s`` replaces the timeout)."""
    from fd_routing_replay.store.redis_client import redis_client_from_config

    section = dataclasses.replace(store_config.redis, url=index_url)
    if timeout_s is not None:
        section = dataclasses.replace(section, socket_timeout_s=timeout_s)
    client, _, location = redis_client_from_config(
        dataclasses.replace(store_config, url=None, redis=section))
    return client, location
