"""FastDeploy's flat ``--routing-replay-config`` JSON: its keys, and how each maps onto the
tree (the store keys come from the backends that declare them)."""

from collections.abc import Iterator, Mapping
from dataclasses import fields
from typing import Any

from fd_routing_replay.config.options import shown as _shown
from fd_routing_replay.config.reference import suggest
from fd_routing_replay.config.schema import BACKENDS, RoutingReplayConfig
from fd_routing_replay.errors import ConfigError

__all__ = ["FASTDEPLOY_KEYS", "FASTDEPLOY_STORE_TYPES", "config_from_fastdeploy", "fastdeploy_pairs",
           "is_fastdeploy_flat"]


def _fastdeploy_keys() -> dict[str, str]:
    """FastDeploy's flat --routing-replay-config keys and where each lands in the tree;
    the store keys come from the backends that declare them."""
    store_keys = {flat: f"store.{backend.name}.{key}" for backend in BACKENDS.values()
                  for flat, key in backend.fastdeploy_keys}
    return {"enable_routing_replay": "enabled", "routing_store_type": "store.type",
            **store_keys, "only_last_turn": "retention.only_last_turn",
            "use_fused_put": "capture.fused"}


FASTDEPLOY_KEYS: dict[str, str] = _fastdeploy_keys()
#: FastDeploy's routing_store_type values and the backend each selects.
FASTDEPLOY_STORE_TYPES = {backend.fastdeploy_type: backend.name for backend in BACKENDS.values()
                           if backend.fastdeploy_type}


def is_fastdeploy_flat(data: Mapping[str, Any]) -> bool:
    """True when a mapping is FastDeploy's flat ``--routing-replay-config`` form."""
    return any(key in FASTDEPLOY_KEYS for key in data)


def fastdeploy_pairs(flat: Mapping[str, Any], source: str) -> Iterator[tuple[str, Any, str]]:
    """Yield (tree path, value, flat key) for each set key of a FastDeploy flat dict."""
    if not isinstance(flat, Mapping):
        raise ConfigError(
            f"FastDeploy routing-replay config must be a JSON object, got {_shown(flat)} (from {source})"
        )
    known = list(FASTDEPLOY_KEYS)
    for key, value in flat.items():
        if key not in FASTDEPLOY_KEYS:
            hint = suggest(str(key), known)
            if key in {f.name for f in fields(RoutingReplayConfig)}:
                hint = "; nested keys cannot be mixed with FastDeploy's flat keys in one mapping"
            raise ConfigError(
                f"unknown FastDeploy routing-replay key {key!r} (from {source}){hint}; "
                f"known flat keys: {', '.join(known)}"
            )
        if value is None or value == "None":  # FastDeploy's spelling of "not set"
            continue
        if key == "routing_store_type":
            if value not in FASTDEPLOY_STORE_TYPES:
                raise ConfigError(
                    f"routing_store_type (store.type): invalid value {_shown(value)}; allowed: "
                    f"'local', 'rdma' (from {source})"
                )
            value = FASTDEPLOY_STORE_TYPES[value]
        yield FASTDEPLOY_KEYS[key], value, key


def config_from_fastdeploy(
    flat: Mapping[str, Any], *, source: str = "FastDeploy config"
) -> dict[str, Any]:
    """Map FastDeploy's flat ``--routing-replay-config`` dict onto a nested config dict.

    Keys whose value is the string ``"None"`` (or null) count as not set, as in
    FastDeploy; every other key must be one of FastDeploy's six.  Values are checked
    when the result is loaded.
    """
    nested: dict[str, Any] = {}
    for path, value, _ in fastdeploy_pairs(flat, source):
        node = nested
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return nested
