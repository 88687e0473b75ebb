"""Sliced reads: one trainer rank's layers and tokens of a record, not the whole record.

A 60-layer, 32k-token, top-8 record is 15.7 MB; with pipeline and context parallelism a
rank needs its own layers and token chunks, e.g. 1/64 of it.  Where the store can read
byte ranges (the optional ``read_ranges(key, [(offset, length), ...])`` capability: the
local store by ``pread``, Redis by whole chunks of ``store.redis.chunk_bytes``),
:func:`read_slice` fetches the header, then one range per wanted layer:
``[layers, tokens, top_k]`` is row-major, so a layer's token span is contiguous.
Elsewhere (P2PStore, Mooncake today: their clients read whole values; ``set``-encoded,
``fastdeploy-raw`` and per-layer records) it reads the whole record and slices it in
memory: same result.

A ranged read checks the header and every returned id (range, rollout id) but cannot
verify the payload checksum, which covers the whole payload: use
:meth:`RoutingReader.get` for a checksum-verified read.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from fd_routing_replay.codec.header import MAGIC, PREFIX, PREFIX_BYTES
from fd_routing_replay.codec.record import RoutingRecord, check_expert_range
from fd_routing_replay.codec.rr_v1 import read_header
from fd_routing_replay.errors import RecordError

__all__ = ["read_slice", "slice_record"]

_HEAD_BYTES = 4096


def _token_span(tokens: slice | None, num_tokens: int) -> tuple[int, int]:
    if tokens is None:
        return 0, num_tokens
    if not isinstance(tokens, slice) or tokens.step not in (None, 1):
        raise ValueError(f"tokens must be a slice with step 1 (e.g. slice(0, 4096)), got {tokens!r}")
    start, stop, _ = tokens.indices(num_tokens)
    return start, max(start, stop)


def _rows(layer_map: tuple[int, ...], layers: Any) -> list[int]:
    """Rows of the record for the wanted decoder layers (the record's layer map)."""
    if layers is None:
        return list(range(len(layer_map)))
    row_of = {layer: row for row, layer in enumerate(layer_map)}
    wanted = sorted({int(layer) for layer in layers})
    missing = [layer for layer in wanted if layer not in row_of]
    if missing:
        raise ValueError(f"decoder layers {missing} are not in the record (its layer map: "
                         f"{list(layer_map)})")
    return [row_of[layer] for layer in wanted]


def slice_record(record: RoutingRecord, *, layers: Any = None,
                 tokens: slice | None = None) -> RoutingRecord:
    """The rows of decoder ``layers`` (default: all) and the positions ``tokens`` of
    ``record``.  A token slice drops the tokens hash and segments (they describe the
    whole sequence) and puts its start in ``metadata["token_offset"]``."""
    rows = _rows(record.layer_map, layers)
    start, stop = _token_span(tokens, record.num_tokens)
    ids = np.ascontiguousarray(record.ids[rows, start:stop])
    return _sliced(record, record.num_tokens, ids, rows, start, stop)


def _sliced(record: RoutingRecord, num_tokens: int, ids: np.ndarray, rows: list[int],
            start: int, stop: int) -> RoutingRecord:
    """``record``'s fields around the sliced ``ids`` (``record.ids`` is not read)."""
    whole_tokens = (start, stop) == (0, num_tokens)
    provenance = record.provenance if whole_tokens else replace(
        record.provenance, tokens_hash=None, segments=None)
    metadata = dict(record.metadata)
    if not whole_tokens:
        metadata["token_offset"] = start
    return RoutingRecord(record.rollout_id, ids, record.num_experts, record.fill_value, metadata,
                         created=record.created, producer=record.producer,
                         layers=tuple(record.layer_map[row] for row in rows),
                         token_convention=record.token_convention, provenance=provenance)


def read_slice(store: Any, key: str, *, layers: Any = None, tokens: slice | None = None
               ) -> tuple[RoutingRecord, int] | None:
    """``(sliced record, bytes fetched)`` by byte ranges, or None when the store cannot
    read ranges or the value is not a plain rr-v1 record (the caller reads it whole).
    Raises RecordError for a malformed header, ValueError for layers not in the record."""
    read_ranges = getattr(store, "read_ranges", None)
    if read_ranges is None:
        return None
    got = read_ranges(key, [(0, _HEAD_BYTES)])
    if got is None:
        return None
    head = got[0]
    fetched = len(head)
    if len(head) < PREFIX_BYTES or head[:len(MAGIC)] != MAGIC:
        return None                              # FastDeploy's formats: read whole
    header_end = PREFIX_BYTES + PREFIX.unpack_from(head)[2]
    if header_end > len(head):
        (head,) = read_ranges(key, [(0, header_end)])
        fetched += len(head)
    header = read_header(head, require_payload=False)
    if header.encoding != "plain":
        return None                              # bit-packed rows: read whole
    num_layers, num_tokens, top_k = header.shape
    layer_map = header.layer_map
    rows = _rows(layer_map, layers)
    start, stop = _token_span(tokens, num_tokens)
    dtype = header.ids_dtype
    row_bytes = top_k * dtype.itemsize
    base = header.payload_offset
    ranges = [(base + (row * num_tokens + start) * row_bytes, (stop - start) * row_bytes)
              for row in rows]
    parts = read_ranges(key, ranges) if ranges and stop > start else [b""] * len(rows)
    if parts is None:
        return None                              # deleted between the two reads
    fetched += sum(len(part) for part in parts)
    if any(len(part) != length for part, (_, length) in zip(parts, ranges, strict=True)):
        raise RecordError(f"record {key!r} is shorter than its header says (truncated)")
    ids = np.frombuffer(b"".join(parts), dtype=dtype).reshape(len(rows), stop - start, top_k)
    fields = RoutingRecord(header.rollout_id, np.empty((num_layers, 0, top_k), dtype),
                           header.num_experts, header.fill_value, header.metadata,
                           created=header.created, producer=header.producer,
                           layers=layer_map, token_convention=header.token_convention,
                           provenance=header.provenance)
    sliced = _sliced(fields, num_tokens, ids, rows, start, stop)
    check_expert_range(sliced)
    return sliced, fetched
