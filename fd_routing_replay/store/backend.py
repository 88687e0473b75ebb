"""The public face of the backend catalogue for third-party backends: a module declaring
``BACKEND = StoreBackend(...)`` imports :class:`StoreBackend`, :class:`Section`,
:func:`option` and :class:`Capability` from here (docs/stores.md, "Writing a backend").
The declarations themselves and their discovery live in :mod:`fd_routing_replay.config.backends`.
"""

from __future__ import annotations

from fd_routing_replay.config.backends import (
    DECLARATION,
    ENTRY_POINT_GROUP,
    Capability,
    LazyHook,
    RedisTarget,
    Section,
    StoreBackend,
    backend_named,
    backends,
    option,
)

__all__ = ["DECLARATION", "ENTRY_POINT_GROUP", "Capability", "LazyHook", "RedisTarget", "Section",
           "StoreBackend", "backend_named", "backends", "option"]
