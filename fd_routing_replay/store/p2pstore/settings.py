"""The effective P2PStore settings: the ``store.p2pstore`` section, a ``p2pstore://`` URL
over it, and the checks P2PStore's own client would fail on later and less clearly."""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs, urlsplit

from fd_routing_replay.config.stores.p2pstore import LAYOUTS
from fd_routing_replay.core.redact import redact_url
from fd_routing_replay.errors import ConfigError

__all__ = ["p2pstore_settings"]


def p2pstore_settings(store_config: Any) -> dict[str, Any]:
    """The effective P2PStore settings: ``store.p2pstore`` overridden by a ``p2pstore://`` URL.

    ``p2pstore://[user:password@]host:port/db?protocol=tcp&device=mlx5_0&local_host=…``
    names the metadata Redis (as ``redis://…``) and may override the section's keys;
    ``layout=fastdeploy&max_model_len=N`` selects FastDeploy's own keys and values.
    """
    section = store_config.p2pstore
    settings = {name: getattr(section, name) for name in
                ("metadata_server", "protocol", "device", "local_host", "log_dir",
                 "max_delete_batch")}
    settings["layout"] = getattr(section, "layout", "tree")
    settings["max_model_len"] = getattr(section, "max_model_len", None)
    url = store_config.url
    if url and urlsplit(url).scheme == "p2pstore":
        parts = urlsplit(url)
        if parts.netloc:
            settings["metadata_server"] = f"redis://{parts.netloc}{parts.path or '/0'}"
        for name, values in parse_qs(parts.query).items():
            if name not in settings or name == "metadata_server":
                raise ConfigError(f"store.url {parts.scheme}://{parts.hostname}…: unknown "
                                  f"option {name!r}; known: protocol, device, local_host, "
                                  f"log_dir, max_delete_batch, layout, max_model_len")
            settings[name] = (_positive_int(f"store.url option {name}", values[-1])
                              if name in ("max_delete_batch", "max_model_len") else values[-1])
    if settings["layout"] not in LAYOUTS:
        raise ConfigError(f"store.p2pstore.layout must be one of {', '.join(LAYOUTS)}, got "
                          f"{settings['layout']!r}")
    max_model_len = settings["max_model_len"]
    if max_model_len is not None:
        if settings["layout"] != "fastdeploy":
            raise ConfigError("store.p2pstore.max_model_len only applies to layout fastdeploy "
                              "(the tree layout stores records as they come)")
        if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) \
                or max_model_len < 1:
            raise ConfigError(f"store.p2pstore.max_model_len must be a positive integer or "
                              f"null, got {max_model_len!r}")
    if not settings["metadata_server"]:
        raise ConfigError("store.p2pstore.metadata_server is required for the p2pstore store "
                          "(a Redis URL such as redis://10.0.0.5:6379/0), or use "
                          "store.url: p2pstore://host:port/db")
    if settings["protocol"] not in ("rdma", "tcp"):
        raise ConfigError(f"store.p2pstore.protocol must be rdma or tcp, got "
                          f"{settings['protocol']!r}")
    scheme = urlsplit(settings["metadata_server"]).scheme
    if scheme not in ("redis", "redis+sentinel"):
        raise ConfigError(
            f"P2PStore cannot use a {scheme}:// metadata server ({redact_url(settings['metadata_server'])}): "
            "it supports redis:// and redis+sentinel:// (its Redis Cluster mode fails at client "
            "start and runs scripts across slots; rediss:// is not parsed)")
    return settings


def _positive_int(what: str, text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"{what} must be a positive integer, got {text!r}")
    return int(text)
