"""Records in P2PStore (RDMA through Mooncake, or its TCP transport where no NIC exists),
with our prefix index in its metadata Redis.  :func:`open_p2pstore_store` opens the tree
layout (:class:`P2PStoreStore`) or FastDeploy's own bare keys and raw values.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from fd_routing_replay.config.stores.p2pstore import p2pstore_settings
from fd_routing_replay.core.redact import redact_text, redact_url
from fd_routing_replay.errors import (
    ConfigError,
    ProviderUnavailableError,
    TransientStoreError,
)
from fd_routing_replay.keys import check_namespace
from fd_routing_replay.store.p2pstore.keys import decode_component, encode_component, stored_key
from fd_routing_replay.store.p2pstore.runtime import (
    AsyncBridge,
    LogWriter,
    import_p2pstore,
    resolve_log_dir,
)
from fd_routing_replay.store.p2pstore.runtime import choose_transport as _choose_transport
from fd_routing_replay.store.p2pstore.runtime import local_host as _local_host
from fd_routing_replay.store.p2pstore.runtime import metadata_client as _redis_client
from fd_routing_replay.store.p2pstore.runtime import trusted_device as _trusted_device
from fd_routing_replay.store.p2pstore.store import P2PStoreStore

log = logging.getLogger(__name__)

__all__ = ["P2PStoreStore", "ProviderUnavailableError", "decode_component",
           "encode_component", "open_p2pstore_store", "p2pstore_settings", "stored_key"]


def open_p2pstore_store(store_config: Any) -> P2PStoreStore:
    """Factory for ``type: p2pstore`` and ``p2pstore://`` URLs."""
    settings = p2pstore_settings(store_config)
    namespace = check_namespace(store_config.namespace)
    timeout_s = float(getattr(store_config.redis, "socket_timeout_s", 5.0))
    log_dir = resolve_log_dir(settings.log_dir)
    module = import_p2pstore(log_dir)
    protocol, device = _choose_transport(settings.protocol, settings.device)
    local_host = _local_host(settings.local_host, protocol)
    location = redact_url(settings.metadata_server)
    with _trusted_device(protocol, device):
        try:
            p2p_config = module.P2PConfig(
                metadata_server=settings.metadata_server, local_host=local_host,
                protocol=protocol, device=device, redis_socket_timeout=timeout_s,
                redis_socket_connect_timeout=timeout_s)
        except ValueError as exc:
            raise ConfigError(f"P2PStore rejected its config ({location}): {redact_text(str(exc))}") from exc
    if p2p_config.protocol != protocol:
        log.warning("P2P_PROTOCOL=%s in the environment overrides store.p2pstore.protocol=%s",
                    p2p_config.protocol, protocol)
    if p2p_config.redis_socket_timeout != timeout_s:
        log.warning("P2P_REDIS_SOCKET_TIMEOUT=%s in the environment overrides the %ss Redis "
                    "timeout of P2PStore's client", p2p_config.redis_socket_timeout, timeout_s)
    redis_client = _redis_client(p2p_config, timeout_s)
    try:
        redis_client.ping()
    except Exception as exc:
        from fd_routing_replay.store.redis_client import translate_error

        raise translate_error(exc, f"P2PStore metadata server {location} is unreachable") \
            from exc
    bridge = AsyncBridge(name=f"p2pstore-{namespace}")
    try:
        with contextlib.redirect_stdout(LogWriter()), _trusted_device(protocol, device):
            client = module.P2PClient(p2p_config)
    except Exception as exc:
        bridge.close()
        redis_client.close()
        message = (f"cannot start a P2PStore client ({protocol} on {local_host}, metadata "
                   f"{location}): {type(exc).__name__}: {redact_text(str(exc))}")
        raise TransientStoreError(message) from exc
    transport = f"{p2p_config.protocol} {client.transport.get_local_addr()}"
    if p2p_config.protocol == "rdma" and p2p_config.device:
        transport += f" device={p2p_config.device}"
    common = {"location": location, "transport": transport, "log_dir": str(log_dir),
              "max_delete_batch": settings.max_delete_batch}
    if settings.layout == "fastdeploy":
        from fd_routing_replay.store.p2pstore.fastdeploy import FastDeployP2PStore

        return FastDeployP2PStore(client, redis_client, bridge, namespace,
                                  max_model_len=settings.max_model_len, **common)
    store = P2PStoreStore(client, redis_client, bridge, namespace, **common)
    store.index.reload_layout()  # one round trip now rather than inside the first call
    return store
