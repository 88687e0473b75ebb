"""The embedded default store: records as files under one root directory.

Two layouts: ``tree`` (rr-v1 records in a tree of prefix buckets, :class:`LocalStore`) and
``fastdeploy`` (FastDeploy's own ``{root}/{rollout_id}/*.pdtensor`` files, for trainers that
read them).  :func:`open_local_store` picks one from the config or a ``local://`` URL.
"""

from __future__ import annotations

from fd_routing_replay.config.stores.local import local_settings
from fd_routing_replay.store.base import RoutingStore
from fd_routing_replay.store.local.tree import LocalStore

__all__ = ["LocalStore", "open_local_store"]


def open_local_store(store_config) -> RoutingStore:  # noqa: ANN001 - StoreConfig
    """Factory for ``type: local`` and ``local:///abs/path`` / ``local://./rel/path``.

    The layout comes from ``store.local.layout`` or the URL query ``?layout=fastdeploy``
    (which may add ``&max_model_len=N`` to pad converted records like FastDeploy does).
    """
    local = local_settings(store_config)
    if local.layout == "fastdeploy":
        from fd_routing_replay.store.local.fastdeploy import FastDeployLocalStore

        return FastDeployLocalStore(local.root, store_config.namespace, fsync=local.fsync,
                                    max_model_len=local.max_model_len)
    return LocalStore(local.root, store_config.namespace, fsync=local.fsync)
