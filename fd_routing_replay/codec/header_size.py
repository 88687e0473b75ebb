"""How big a record's rr-v1 header will be, without encoding (or even reading) its ids.

The size bounded is the msgpack header's (``H``, what the limit applies to); the frame
around it (prefix, version 2's 8-byte header checksum, padding) is not counted.

A writer refuses a record whose header would exceed
:data:`~fd_routing_replay.codec.header.MAX_HEADER_BYTES` on the caller's thread, before
anything is queued.  :func:`quick_header_bound` is a cheap, generous bound;
:func:`encoded_header_bound` is the encoder's own size (through the codec itself), run
only when the quick bound is too big.
"""

from __future__ import annotations

import os
from dataclasses import replace

import msgpack
import numpy as np

from fd_routing_replay.codec.checksum import xxh3_64
from fd_routing_replay.codec.framing import PREFIX
from fd_routing_replay.codec.header import pack_layer_map
from fd_routing_replay.codec.record import MAX_LAYER_INDEX, RoutingRecord
from fd_routing_replay.codec.rr_v1 import encode_record_parts

__all__ = ["encoded_header_bound", "quick_header_bound"]

_UINT32_BYTES = 5   # msgpack uint 32: the widest pid
_UINT64_BYTES = 9   # msgpack uint 64: the widest checksum
_ARRAY_HEADER_BYTES = 5  # msgpack array 32: the widest list header
_ID_LENGTH_BYTES = 3  # msgpack str 16: the rollout id's length prefix
_EMPTY_CHECKSUM = xxh3_64(b"")
# Generous sizes for quick_header_bound: the default layer map ({"s", "n"}), the default
# producer (version, host name cut to 64 characters, pid) and every other field with its key.
_LAYER_MAP_BYTES = 32
_PRODUCER_BYTES = 400
_OTHER_FIELDS_BYTES = 320


def _packed_uint_size(value: int) -> int:
    """Bytes msgpack uses for the non-negative int ``value``."""
    if value < 128:
        return 1
    if value < 2**8:
        return 2
    if value < 2**16:
        return 3
    if value < 2**32:
        return 5
    return 9


def _packed_layer_map_size(layers: tuple[int, ...]) -> int:
    return len(msgpack.packb(pack_layer_map(layers)))


def encoded_header_bound(record: RoutingRecord) -> int:
    """Size of the msgpack header ``record`` will be encoded with, without reading its ids.

    Encodes a payload-less copy (``[L, 0, K]``) through the codec itself, then accounts for
    what depends on the payload or on the encoding process: the token count, the payload
    length, the checksum (counted at its widest) and, when the record has no ``producer``,
    the encoding process's pid (counted at its widest).  Never below the true size, at most
    12 bytes above it.  RecordError when even the payload-less header is over the limit.
    """
    ids = record.ids
    layers, tokens, top_k = (int(d) for d in ids.shape)
    # The stand-in leaves the layer map out (validating it again would cost more than all
    # the rest); its packed size is accounted for below, with the codec's own packing.
    # Segments are checked against the token count, which the stand-in lacks: counted apart.
    segments = record.provenance.segments
    stand_in = RoutingRecord(record.rollout_id, np.empty((layers, 0, top_k), ids.dtype),
                             record.num_experts, record.fill_value, record.metadata,
                             created=0.0, producer=record.producer,
                             token_convention=record.token_convention,
                             provenance=replace(record.provenance, segments=None))
    head, _ = encode_record_parts(stand_in)
    _, _, length = PREFIX.unpack_from(head)
    stand_in_map = _packed_layer_map_size(stand_in.layer_map)
    layer_map = stand_in_map if record.layers is None else _packed_layer_map_size(record.layer_map)
    bound = (length - stand_in_map + layer_map
             + _packed_uint_size(tokens) - 1 + _packed_uint_size(ids.nbytes) - 1
             + _UINT64_BYTES - _packed_uint_size(_EMPTY_CHECKSUM))
    if record.producer is None:  # filled in by the process that encodes, maybe another pid
        bound += _UINT32_BYTES - _packed_uint_size(os.getpid())
    if segments is not None:
        bound += len(msgpack.packb("sg")) + len(msgpack.packb(list(segments)))
    return bound


def quick_header_bound(record: RoutingRecord, metadata_bytes: int) -> int:
    """A cheap upper bound of the header size (no encoding), generous by a few hundred
    bytes, given the packed size of the record's metadata; the exact
    :func:`encoded_header_bound` need run only when this one is too big."""
    if record.layers is None:
        layer_map = _LAYER_MAP_BYTES
    else:
        layer_map = (_ARRAY_HEADER_BYTES
                     + _packed_uint_size(MAX_LAYER_INDEX) * int(record.ids.shape[0]))
    producer = _PRODUCER_BYTES if record.producer is None else \
        len(msgpack.packb(record.producer, use_bin_type=True))
    provenance = record.provenance.to_header()
    return (metadata_bytes + len(record.rollout_id.encode("utf-8")) + _ID_LENGTH_BYTES
            + layer_map + producer + _OTHER_FIELDS_BYTES
            + (len(msgpack.packb(provenance, use_bin_type=True)) if provenance else 0))
