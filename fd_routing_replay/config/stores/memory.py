"""The memory store's declaration: its catalogue entry (no config section).

Light on purpose (config loads it): the store's code, :mod:`fd_routing_replay.store.memory`,
is named by strings and imported only when the backend is chosen.
"""

from __future__ import annotations

from fd_routing_replay.config.backends import StoreBackend

BACKEND = StoreBackend(name="memory", factory="fd_routing_replay.store.memory:open_memory_store")
