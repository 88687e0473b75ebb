"""Pick and build the manager a configuration asks for."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fd_routing_replay.capture.sink import RecordSink, open_sink
from fd_routing_replay.codec.provenance import Provenance
from fd_routing_replay.codec.record import RecordFormat

__all__ = ["create_manager", "pads_to_max_model_len"]


def pads_to_max_model_len(config: Any) -> bool:
    """Records are padded to max_model_len when asked, and always in FastDeploy's format."""
    return bool(config.capture.pad_to_max_model_len or config.capture.record_format == RecordFormat.FASTDEPLOY_RAW)


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
    identity: Any = None,
    layer_rows: tuple[int, ...] | None = None,
    num_decoder_layers: int | None = None,
) -> Any:
    """A :class:`RoutingReplayManager`, or the no-op twin when ``config.enabled`` is false.

    Only TP rank 0 gets a sink (the background writer unless ``sink`` is given or
    ``inline_writes`` asks for synchronous store writes).  ``identity`` (a
    :class:`~fd_routing_replay.writer.directories.RankIdentity`) is handed to the writer
    so each rank gets its own journal and dead-letter directories.
    """
    if not config.enabled:
        from fd_routing_replay.capture.noop import NoopRoutingReplayManager

        return NoopRoutingReplayManager()
    from fd_routing_replay.capture.manager import RoutingReplayManager

    if sink is None and tp_rank == 0:
        sink = open_sink(config, max_model_len=geometry.max_model_len, inline=inline_writes,
                         identity=identity)
    manager = RoutingReplayManager(
        geometry, block_table=block_table, sink=sink, tp_rank=tp_rank,
        fused=config.capture.fused, pad_to_max_model_len=pads_to_max_model_len(config),
        share_inputs=share_inputs, place=place, metadata=metadata, layer_rows=layer_rows)
    if manager.assembler is not None:   # provenance: decoder-layer count, weights version
        manager.assembler.provenance = Provenance(
            num_decoder_layers=num_decoder_layers,
            weights_version=config.capture.weights_version or None)
    manager.enable_partials(config.capture.partial_every_tokens)   # rank 0, with a sink
    export = getattr(sink, "export_metrics", None)  # the background writer serves them
    if export is not None:
        export(manager.stats)
    return manager
