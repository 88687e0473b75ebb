"""Sliced reads: one trainer rank's layers and tokens of a record, not the whole record.

A 60-layer, 32k-token, top-8 record is 15.7 MB; with pipeline and context parallelism a
rank needs its own layers and token chunks, e.g. 1/64 of it.  Where the store can read
byte ranges, :func:`read_slice` fetches the header, then one range per wanted layer:
``[layers, tokens, top_k]`` is row-major, so a layer's token span is contiguous.
Elsewhere (P2PStore, Mooncake today: their clients read whole values; ``set``-encoded,
``fastdeploy-raw`` and per-layer records) it reads the whole record and slices it in
memory: same result.

Ranged reads trust nothing in the header: everything it implies (header extent, record
length, the ranges) is checked against the stored size before anything is allocated or
asked for, and the record's length must be exactly the header's (``RecordError``
otherwise).  A record replaced meanwhile is read again, never mixed: the store's
``open_ranges(key)`` capability (the local store: one open file; Redis: ``WATCH``) gives
the size and ranges of one version and tells whether it changed; a store with only
``read_ranges(key, ranges)`` (each call one version) is probed for the length and its
header bytes are re-read with the payload ranges and compared.  A ranged read checks the
header and every returned id (range, rollout id) but cannot verify the payload checksum,
which covers the whole payload: use :meth:`RoutingReader.get` for a checksum-verified read.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from fd_routing_replay.codec.header import MAGIC, RecordHeader, header_region_length
from fd_routing_replay.codec.record import RoutingRecord, check_expert_range
from fd_routing_replay.codec.rr_v1 import read_header
from fd_routing_replay.errors import RecordError
from fd_routing_replay.reader.ranged import RangesView, open_view

__all__ = ["read_slice", "slice_record"]

_HEAD_BYTES = 4096
"""First read: the header of every usual record fits (a bigger one is read again)."""
_TRIES = 4
"""Reads of a record that keeps changing meanwhile before giving up (RecordError)."""


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
    Raises RecordError for a malformed, truncated or overlong record, and for one that
    changed while being read :data:`_TRIES` times in a row; ValueError for layers not in
    the record."""
    for _ in range(_TRIES):
        view = open_view(store, key)
        if view is None:
            return None
        with view:
            try:
                got = _read_once(view, key, layers, tokens)
            except (RecordError, ValueError):
                if view.unchanged():
                    raise
                continue                             # what was read mixed two versions
            if got is None or view.unchanged():
                return got                           # None: read whole, on its own
    raise RecordError(f"record {key!r} changed while being read, {_TRIES} times in a row; "
                      "read it again")


def _header(view: Any, head: bytes, size: int | None) -> tuple[RecordHeader, bytes]:
    """The header of the record starting with ``head``, reading the rest of it (at most
    the header limit, at most the stored size) when it does not fit in ``head``."""
    try:
        return read_header(head, require_payload=False), head
    except RecordError:
        if len(head) < _HEAD_BYTES or len(head) == size:
            raise                                    # the whole value was read
        wanted = header_region_length(head)      # bounded: RecordError past the limit
        if size is not None:
            wanted = min(wanted, size)
        got = view.read([(0, wanted)])
        if got is None or len(got[0]) <= len(head):
            raise
        return read_header(got[0], require_payload=False), got[0]


def _check_length(key: str, size: int, record_length: int, exact: bool) -> None:
    if size < record_length:
        stored = f"{size} bytes stored" if exact else "fewer bytes stored"
        raise RecordError(f"truncated record {key!r}: {stored}, its header promises "
                          f"{record_length}")
    if size > record_length:
        extra = f"{size - record_length} unexpected bytes" if exact else "unexpected bytes"
        raise RecordError(f"record {key!r}: {extra} after the payload (its header promises "
                          f"{record_length} bytes)")


def _read_once(view: Any, key: str, layers: Any, tokens: slice | None
               ) -> tuple[RoutingRecord, int] | None:
    """One read of one view: header, length check, the wanted rows; None: read it whole."""
    size = view.size                           # None: a store with read_ranges only
    got = view.read([(0, _HEAD_BYTES if size is None else min(size, _HEAD_BYTES))])
    if got is None or got[0][:len(MAGIC)] != MAGIC:
        return None                            # absent, or FastDeploy's formats: read whole
    header, head = _header(view, got[0], size)
    if header.encoding != "plain":
        return None                            # bit-packed rows: read whole
    record_length = header.payload_offset + header.payload_length
    fetched = len(got[0]) + (len(head) if head is not got[0] else 0)
    if isinstance(view, RangesView):
        pinned = head[:min(len(head), header.payload_offset)]
        _check_length(key, view.pin(pinned, record_length), record_length, exact=False)
        fetched += len(pinned) + 2
    else:
        _check_length(key, size, record_length, exact=True)
    num_layers, num_tokens, top_k = header.shape
    rows = _rows(header.layer_map, layers)
    start, stop = _token_span(tokens, num_tokens)
    dtype = header.ids_dtype
    row_bytes = top_k * dtype.itemsize
    base = header.payload_offset
    # Within the record, so within what is stored: bounded by the stored size.
    ranges = [(base + (row * num_tokens + start) * row_bytes, (stop - start) * row_bytes)
              for row in rows] if stop > start else []
    parts = view.read(ranges) if ranges or isinstance(view, RangesView) else []
    if parts is None:
        return None                            # deleted meanwhile: read whole
    fetched += sum(len(part) for part in parts)
    if any(len(part) != length for part, (_, length) in zip(parts, ranges, strict=True)):
        raise RecordError(f"record {key!r} is shorter than its header says (truncated)")
    ids = np.frombuffer(b"".join(parts), dtype=dtype).reshape(len(rows), stop - start, top_k)
    fields = RoutingRecord(header.rollout_id, np.empty((num_layers, 0, top_k), dtype),
                           header.num_experts, header.fill_value, header.metadata,
                           created=header.created, producer=header.producer,
                           layers=header.layer_map, token_convention=header.token_convention,
                           provenance=header.provenance)
    sliced = _sliced(fields, num_tokens, ids, rows, start, stop)
    check_expert_range(sliced)
    return sliced, fetched
