"""The background writer: records reach the store without touching the engine's step time.

:class:`RoutingWriter` takes puts and deletes on the engine's threads and hands them to a
writer process (or thread) that encodes them, stores them in submission order, retries,
journals what the store cannot take yet and replays it.  docs/operations.md has the
operator's view.
"""

from __future__ import annotations

from fd_routing_replay.writer.client import RoutingWriter

__all__ = ["RoutingWriter"]
