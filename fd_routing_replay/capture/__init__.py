"""Capture: the device routing table, the host slot cache and per-request assembly.

``RoutingReplayManager`` has FastDeploy's runner interface; ``NoopRoutingReplayManager``
is its do-nothing twin for when routing replay is off; ``save_routing_to_buffer`` is the
MoE-layer hook.  ``create_manager`` picks one from a config.  Importing this package
imports Paddle (through the ops) only when a manager module is used.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "CaptureGeometry": "fd_routing_replay.capture.manager",
    "RoutingReplayManager": "fd_routing_replay.capture.manager",
    "NoopRoutingReplayManager": "fd_routing_replay.capture.noop",
    "save_routing_to_buffer": "fd_routing_replay.capture.hook",
    "HostSlotCache": "fd_routing_replay.capture.host_cache",
    "StepPositions": "fd_routing_replay.capture.positions",
    "RecordSink": "fd_routing_replay.capture.sink",
    "StoreSink": "fd_routing_replay.capture.sink",
    "WriterSink": "fd_routing_replay.capture.sink",
    "open_sink": "fd_routing_replay.capture.sink",
    "create_manager": "fd_routing_replay.capture.factory",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fd_routing_replay.capture' has no attribute {name!r}")
    return getattr(import_module(module), name)
