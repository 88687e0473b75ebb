"""Rollout Routing Replay (R3) for Mixture-of-Experts RL on FastDeploy.

Importing the package is cheap: it never imports FastDeploy, Paddle or any optional
store client.  The public API is re-exported lazily from the modules that own it.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from fd_routing_replay._version import __version__

_EXPORTS = {
    "RoutingRecord": "fd_routing_replay.codec",
    "encode_record": "fd_routing_replay.codec",
    "decode_record": "fd_routing_replay.codec",
    "RolloutId": "fd_routing_replay.keys",
    "parse_rollout_id": "fd_routing_replay.keys",
    "parse_request_id": "fd_routing_replay.keys",
    "load_config": "fd_routing_replay.config",
    "open_store": "fd_routing_replay.store",
    "RoutingReader": "fd_routing_replay.reader",
    "routes_from_response": "fd_routing_replay.reader.references",
    "RoutingWriter": "fd_routing_replay.writer",
    "RoutingReplayError": "fd_routing_replay.errors",
    "ConfigError": "fd_routing_replay.errors",
    "InvalidRolloutId": "fd_routing_replay.errors",
    "RecordError": "fd_routing_replay.errors",
    "RecordFormat": "fd_routing_replay.codec",
    "StoreError": "fd_routing_replay.errors",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fd_routing_replay' has no attribute {name!r}")
    return getattr(import_module(module), name)
