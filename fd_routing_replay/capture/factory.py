"""Pick and build the manager a configuration asks for."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fd_routing_replay.capture.sink import RecordSink, open_sink

__all__ = ["create_manager"]


def create_manager(
    config: Any,
    geometry: Any,
    *,
    block_table: Any,
    tp_rank: int = 0,
    share_inputs: Mapping[str, Any] | None = None,
    sink: RecordSink | None = None,
    inline_writes: bool = False,
    place: Any = None,
    metadata: dict[str, Any] | None = None,
) -> Any:
    """A :class:`RoutingReplayManager`, or the no-op twin when ``config.enabled`` is false.

    Only TP rank 0 gets a sink (the background writer unless ``sink`` is given or
    ``inline_writes`` asks for synchronous store writes).
    """
    if not config.enabled:
        from fd_routing_replay.capture.noop import NoopRoutingReplayManager

        return NoopRoutingReplayManager()
    from fd_routing_replay.capture.manager import RoutingReplayManager

    if sink is None and tp_rank == 0:
        sink = open_sink(config, max_model_len=geometry.max_model_len, inline=inline_writes)
    return RoutingReplayManager(
        geometry, block_table=block_table, sink=sink, tp_rank=tp_rank,
        fused=config.capture.fused, pad_to_max_model_len=config.capture.pad_to_max_model_len,
        share_inputs=share_inputs, place=place, metadata=metadata)
