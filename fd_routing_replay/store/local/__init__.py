"""The embedded default store: records as files under one root directory.

Two layouts: ``tree`` (rr-v1 records in a tree of prefix buckets, :class:`LocalStore`) and
``fastdeploy`` (FastDeploy's own ``{root}/{rollout_id}/*.pdtensor`` files, for trainers that
read them).  :func:`open_local_store` picks one from the config or a ``local://`` URL.
"""

from __future__ import annotations

from urllib.parse import parse_qsl, unquote, urlsplit

from fd_routing_replay.config.stores.local import LAYOUTS
from fd_routing_replay.errors import ConfigError
from fd_routing_replay.store.base import RoutingStore
from fd_routing_replay.store.local.tree import LocalStore

__all__ = ["LocalStore", "open_local_store"]


def open_local_store(store_config) -> RoutingStore:  # noqa: ANN001 - StoreConfig
    """Factory for ``type: local`` and ``local:///abs/path`` / ``local://./rel/path``.

    The layout comes from ``store.local.layout`` or the URL query ``?layout=fastdeploy``
    (which may add ``&max_model_len=N`` to pad converted records like FastDeploy does).
    """
    local = store_config.local
    root, layout, max_model_len = local.root, getattr(local, "layout", "tree"), None
    if store_config.url:
        parts = urlsplit(store_config.url)
        root = unquote(parts.netloc + parts.path) or root
        layout, max_model_len = _url_options(store_config.url, parts.query, layout)
    if layout not in LAYOUTS:
        raise ConfigError(f"store.local.layout: unknown layout {layout!r}; expected one of "
                          f"{', '.join(LAYOUTS)}")
    if layout == "fastdeploy":
        from fd_routing_replay.store.local.fastdeploy import FastDeployLocalStore

        return FastDeployLocalStore(root, store_config.namespace, fsync=local.fsync,
                                    max_model_len=max_model_len)
    return LocalStore(root, store_config.namespace, fsync=local.fsync)


def _url_options(url: str, query: str, layout: str) -> tuple[str, int | None]:
    """``layout`` and ``max_model_len`` from a local:// URL's query; others are refused."""
    options = dict(parse_qsl(query, keep_blank_values=True))
    unknown = sorted(set(options) - {"layout", "max_model_len"})
    if unknown:
        raise ConfigError(f"store.url {url!r}: unknown option(s) {', '.join(unknown)}; a "
                          "local:// URL takes layout=tree|fastdeploy and max_model_len=N")
    layout = options.get("layout", layout)
    if layout not in LAYOUTS:
        raise ConfigError(f"store.url {url!r}: unknown layout {layout!r}; expected one of "
                          f"{', '.join(LAYOUTS)}")
    max_model_len = None
    if "max_model_len" in options:
        if layout != "fastdeploy":
            raise ConfigError(f"store.url {url!r}: max_model_len only applies to "
                              "layout=fastdeploy")
        text = options["max_model_len"]
        if not text.isdigit() or int(text) < 1:
            raise ConfigError(f"store.url {url!r}: max_model_len must be a positive integer, "
                              f"got {text!r}")
        max_model_len = int(text)
    return layout, max_model_len
