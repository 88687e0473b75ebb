"""Records in Mooncake Store (``mooncake_master`` and the segments clients mount), with our
prefix index in a Redis.  :func:`open_mooncake_store` starts a ``MooncakeDistributedStore``
client and returns a :class:`MooncakeStore` on it.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from fd_routing_replay.config.stores.mooncake import mooncake_settings
from fd_routing_replay.core.redact import redact_text, redact_url
from fd_routing_replay.errors import TransientStoreError
from fd_routing_replay.keys import check_namespace
from fd_routing_replay.store.mooncake.clients import import_client, index_client, replicate_config
from fd_routing_replay.store.mooncake.codes import ERROR_CODES
from fd_routing_replay.store.mooncake.store import FRAME, MooncakeStore

__all__ = ["ERROR_CODES", "FRAME", "MooncakeStore", "mooncake_settings", "open_mooncake_store"]


def open_mooncake_store(store_config: Any) -> MooncakeStore:
    """Factory for ``type: mooncake`` and ``mooncake://`` URLs."""
    settings = mooncake_settings(store_config)
    namespace = check_namespace(store_config.namespace)
    client_class = import_client()
    redis_client, index_location = index_client(store_config, settings.index_url)
    try:
        redis_client.ping()
    except Exception as exc:
        from fd_routing_replay.store.redis_client import translate_error

        redis_client.close()
        raise translate_error(exc, f"the Mooncake store's index Redis {index_location} is "
                                   "unreachable") from exc
    local_host = settings.local_host or os.environ.get("POD_IP", "").strip() or "127.0.0.1"
    setup = {
        "local_hostname": local_host,
        "metadata_server": settings.metadata_server,
        "global_segment_size": int(settings.global_segment_size),
        "local_buffer_size": int(settings.local_buffer_size),
        "protocol": settings.protocol,
        "rdma_devices": settings.device if settings.protocol == "rdma" else "",
        "master_server_addr": settings.master_server,
    }
    location = redact_url(settings.master_server)
    client = client_class()
    try:
        code = client.setup(setup)
    except Exception as exc:  # noqa: BLE001 - reported as a store error
        redis_client.close()
        raise TransientStoreError(f"cannot start a Mooncake client (master {location}): "
                                  f"{type(exc).__name__}: {redact_text(str(exc))}") from exc
    if code != 0:
        redis_client.close()
        with contextlib.suppress(Exception):
            client.close()
        raise TransientStoreError(
            f"cannot start a Mooncake client ({settings.protocol} on {local_host}, master "
            f"{location}, metadata {redact_url(settings.metadata_server)}): setup returned "
            f"{code}; is mooncake_master running there, and the metadata server right? (its "
            f"log above says why)")
    store = MooncakeStore(
        client, redis_client, namespace, location=location,
        replicate_config=replicate_config(settings),
        local_buffer_size=int(settings.local_buffer_size),
        force_remove=bool(settings.force_remove), lease_wait_s=float(settings.lease_wait_s),
        max_batch=int(settings.max_batch), master_http=settings.master_http,
        index_location=index_location, transport=f"{settings.protocol} {local_host}",
        index_buckets=int(getattr(store_config.redis, "index_buckets", 1)))
    store.index.reload_layout()
    return store
