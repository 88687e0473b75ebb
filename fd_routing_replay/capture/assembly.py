"""Per-request assembly: a finished request's KV slots become its routing record(s).

At finish the request's positions ``0 .. length-1`` are mapped to KV slots (through its
block table, so prefix-cache hits are included) and one ``pack_routing`` gathers their
rows from the host slot cache into a contiguous ``[layers, tokens, top_k]`` array.  That
array becomes one self-describing record (fused), or one record per layer keyed
``{rollout_id}_{layer}`` (FastDeploy's non-fused mode).  Every record carries the layer
map: the global decoder-layer index of each of its rows (a per-layer record's single row
maps to its layer's index), so a trainer replays row ``l`` into the right decoder layer
even when the model starts with dense layers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fd_routing_replay import ops
from fd_routing_replay.capture.host_cache import HostSlotCache
from fd_routing_replay.capture.positions import request_slots
from fd_routing_replay.codec import RoutingRecord, check_layer_map
from fd_routing_replay.codec.provenance import Provenance
from fd_routing_replay.keys import layer_key

__all__ = ["AssembledRecord", "RecordAssembler", "report_gaps"]

logger = logging.getLogger(__name__)


@dataclass
class AssembledRecord:
    """The (key, record) pairs of one request, and how many tokens lack routing."""

    rollout_id: str
    items: list[tuple[str, RoutingRecord]]
    num_tokens: int
    missing_tokens: int


class RecordAssembler:
    """Builds records from a :class:`HostSlotCache` (see module docstring).

    ``layer_map`` gives, for each of the cache's ``L`` MoE layers, its global
    decoder-layer index (e.g. ``range(3, 61)`` for DeepSeek-V3, whose first three decoder
    layers are dense); default ``range(L)``.
    """

    def __init__(self, host_cache: HostSlotCache, *, num_experts: int, fused: bool = True,
                 pad_to: int | None = None, metadata: dict[str, Any] | None = None,
                 layer_map: Sequence[int] | None = None,
                 provenance: Provenance | None = None) -> None:
        self.host_cache = host_cache
        self.num_experts = num_experts
        self.fused = fused
        self.pad_to = pad_to
        self.metadata = dict(metadata or {})
        self.provenance = provenance or Provenance()   # decoder-layer count, weights version
        num_layers = host_cache.num_layers
        self.layer_map = check_layer_map(range(num_layers) if layer_map is None else layer_map,
                                         num_layers, what="RecordAssembler layer_map")

    def assemble(self, rollout_id: str, slots: np.ndarray, *,
                 request_id: str | None = None) -> AssembledRecord:
        """Gather ``slots`` (one KV slot per position, in order) into records."""
        return self.build(rollout_id, self.gather(slots), request_id=request_id)

    def gather(self, slots: np.ndarray) -> np.ndarray:
        """The rows of ``slots`` as a new C-contiguous ``[layers, tokens, top_k]`` array.

        The part of :meth:`assemble` that must run before the slots can be reused (one
        compiled pack); :meth:`build` may run later, on another thread.
        """
        cache = self.host_cache
        ids = ops.pack_routing(cache.array, slots)
        ids = ids.numpy() if hasattr(ids, "numpy") else ids
        if getattr(cache, "layer_columns", None) is not None:   # rows laid out for FastDeploy too
            ids = ids[cache.layer_columns]
        return np.ascontiguousarray(ids)

    def gather_request(self, block_row: Any, length: int, block_size: int, *, start: int = 0) -> np.ndarray:
        """:meth:`gather` of positions ``start .. length-1`` of one request, through its
        block-table row: one compiled call for a small record (the library's
        ``pack_request``), the KV slots and the tiled pack otherwise.  Raises naming the
        problem when a position has no KV block."""
        row = np.asarray(block_row).reshape(-1)
        cache = self.host_cache
        pack = ops.request_packer()
        if (pack is not None and getattr(cache, "layer_columns", None) is None and row.dtype.kind == "i"
                and (length - start) * cache.array[0].nbytes < ops.SMALL_PACK_BYTES):
            return pack(cache.array, np.ascontiguousarray(row), int(start), int(length), int(block_size))
        return self.gather(request_slots(row, length, block_size)[start:])

    def build(self, rollout_id: str, ids: np.ndarray, *,
              request_id: str | None = None) -> AssembledRecord:
        """Records of ``ids`` (what :meth:`gather` returned, now owned by the record)."""
        cache = self.host_cache
        num_tokens = int(ids.shape[1])
        missing = ops.count_unrouted(ids, cache.fill_value) if num_tokens else 0
        if self.pad_to is not None and num_tokens < self.pad_to:
            padded = np.full((ids.shape[0], self.pad_to, ids.shape[2]), cache.fill_value, ids.dtype)
            padded[:, :num_tokens] = ids
            ids = padded
        metadata = dict(self.metadata)
        metadata["num_tokens"] = num_tokens
        if request_id is not None:
            metadata["request_id"] = request_id
        if missing:
            metadata["missing_tokens"] = missing
        if self.fused:
            record = RoutingRecord(rollout_id, ids, self.num_experts, cache.fill_value, metadata,
                                   layers=self.layer_map, provenance=self.provenance)
            items = [(rollout_id, record)]
        else:
            num_layers = int(ids.shape[0])
            items = []
            for layer in range(num_layers):
                layer_meta = dict(metadata, layer=layer, num_layers=num_layers)
                record = RoutingRecord(rollout_id, np.ascontiguousarray(ids[layer:layer + 1]),
                                       self.num_experts, cache.fill_value, layer_meta,
                                       layers=(self.layer_map[layer],), provenance=self.provenance)
                items.append((layer_key(rollout_id, layer), record))
        return AssembledRecord(rollout_id, items, num_tokens, missing)


def report_gaps(assembled: AssembledRecord, count: Callable[[str], None]) -> AssembledRecord:
    """Count (``count("records_incomplete")``) and log a record with tokens lacking routing;
    it is still stored."""
    if assembled.missing_tokens:
        count("records_incomplete")
        logger.warning("routing replay: rollout %s has %d of %d tokens without routing "
                       "(stored with the fill value)", assembled.rollout_id, assembled.missing_tokens,
                       assembled.num_tokens)
    return assembled
