"""The effective Mooncake settings: the ``store.mooncake`` section with a ``mooncake://``
URL's query options over it, checked before any client starts."""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs, urlsplit

from fd_routing_replay.config.stores.mooncake import PINS
from fd_routing_replay.errors import ConfigError

__all__ = ["mooncake_settings"]

_URL_OPTIONS = ("index_url", "metadata_server", "protocol", "device", "local_host",
                "global_segment_size", "local_buffer_size", "replica_num", "pin",
                "force_remove", "lease_wait_s", "max_batch", "master_http", "preferred_segment")


def mooncake_settings(store_config: Any) -> dict[str, Any]:
    """The effective settings: ``store.mooncake`` overridden by a ``mooncake://`` URL.

    ``mooncake://host:port?index_url=redis%3A%2F%2Fh%3A6379%2F0&protocol=tcp&…`` names the
    master's RPC address; query options are the section's keys.
    """
    section = store_config.mooncake
    settings = {name: getattr(section, name) for name in ("master_server", *_URL_OPTIONS)}
    url = store_config.url
    if url and urlsplit(url).scheme == "mooncake":
        parts = urlsplit(url)
        if parts.netloc:
            settings["master_server"] = parts.netloc
        for name, values in parse_qs(parts.query).items():
            if name not in _URL_OPTIONS:
                raise ConfigError(f"store.url mooncake://{parts.netloc}: unknown option "
                                  f"{name!r}; known: {', '.join(_URL_OPTIONS)}")
            settings[name] = _url_value(name, values[-1], getattr(section, name))
    if not settings["master_server"]:
        raise ConfigError("store.mooncake.master_server is required for the mooncake store "
                          "(host:port of mooncake_master's RPC port), or use store.url: "
                          "mooncake://host:port")
    if not settings["index_url"]:
        raise ConfigError("store.mooncake.index_url is required: the Redis that holds the "
                          "prefix index (redis://host:6379/0, rediss://, redis+cluster://)")
    if settings["pin"] not in PINS:
        raise ConfigError(f"store.mooncake.pin must be one of {', '.join(PINS)}, got "
                          f"{settings['pin']!r}")
    if settings["protocol"] not in ("tcp", "rdma"):
        raise ConfigError(f"store.mooncake.protocol must be tcp or rdma, got "
                          f"{settings['protocol']!r}")
    return settings


def _url_value(name: str, text: str, default: Any) -> Any:
    if isinstance(default, bool):
        if text.lower() not in ("true", "false", "1", "0"):
            raise ConfigError(f"store.url option {name} must be true or false, got {text!r}")
        return text.lower() in ("true", "1")
    if isinstance(default, int):
        if not text.isdigit():
            raise ConfigError(f"store.url option {name} must be a non-negative integer, got "
                              f"{text!r}")
        return int(text)
    if isinstance(default, float):
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"store.url option {name} must be a number, got {text!r}") from None
    return text
