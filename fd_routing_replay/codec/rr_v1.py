"""Routing record format ``rr-v1``: encode, decode and read the header of one record.

One finished request becomes one self-describing record: a small msgpack header that says
what the payload is (rollout id, dtype, shape, fill value, checksum, ...) followed by the
raw ``[layers, tokens, top_k]`` array.  The payload never goes through msgpack (that would
cost an extra copy) and nothing is pickled.  Decoding is zero-copy: the returned array is
a read-only view on the caller's buffer.  The byte layout and the header's fields are in
:mod:`fd_routing_replay.codec.header`.

How big a record's header will be is known before encoding it (or even reading its ids):
a writer refuses a record whose msgpack header (``H``, what the limit applies to; the
frame around it is not counted) would exceed
:data:`~fd_routing_replay.codec.header.MAX_HEADER_BYTES` on the caller's thread, before
anything is queued.  :func:`quick_header_bound` is a cheap, generous bound;
:func:`encoded_header_bound` is the encoder's own size (through :func:`encode_record_parts`
itself), run only when the quick bound is too big.
"""

from __future__ import annotations

import math
import os
import socket
import time
from dataclasses import replace
from functools import lru_cache
from typing import Any

import msgpack
import numpy as np

from fd_routing_replay._version import __version__
from fd_routing_replay.codec.checksum import xxh3_64
from fd_routing_replay.codec.header import (
    CHECKSUM_ALGORITHM,
    CODEC,
    ENCODINGS,
    LAYOUT,
    MAX_HEADER_BYTES,
    PREFIX,
    RecordHeader,
    frame_header,
    pack_layer_map,
    parse_header,
)
from fd_routing_replay.codec.record import (
    MAX_LAYER_INDEX,
    RoutingRecord,
    check_expert_range,
    dtype_name,
)
from fd_routing_replay.codec.setcodec import decode_sets, encode_sets
from fd_routing_replay.errors import RecordError

__all__ = ["decode_record", "encode_record", "encode_record_parts", "encoded_header_bound",
           "quick_header_bound", "read_header"]


@lru_cache(maxsize=1)
def _host() -> str:
    return socket.gethostname()[:64]


def _producer() -> dict[str, Any]:
    return {"v": __version__, "h": _host(), "p": os.getpid()}


def encode_record_parts(record: RoutingRecord, *, encoding: str = "plain") -> tuple[bytes, memoryview]:
    """Encode ``record`` as (header bytes incl. magic and padding, payload view).

    ``plain``: the payload is a read-only view on ``record.ids`` — nothing is copied, the
    payload is only hashed — so a store that writes parts (``put_parts``, ``writev``) moves
    the ids exactly once.  ``set``: the payload is a new buffer of one bit-packed rank per
    token-layer (SetEncodingError, a RecordError, when a row is neither ``top_k`` distinct
    expert ids nor all fill value).  ``header + bytes(payload)`` equals :func:`encode_record`.
    """
    if encoding not in ENCODINGS:
        raise RecordError(f"unknown encoding {encoding!r}; known: {', '.join(ENCODINGS)}")
    record.validate()
    ids = record.ids
    if encoding == "set":
        payload = memoryview(encode_sets(ids, record.num_experts, record.fill_value)).toreadonly()
    else:
        payload = memoryview(ids.reshape(-1).view(np.uint8)).toreadonly()
    header: dict[str, Any] = {
        "id": record.rollout_id,
        "dt": dtype_name(ids.dtype),
        "sh": [int(d) for d in ids.shape],
        "lo": LAYOUT,
        "ne": record.num_experts,
        "k": int(ids.shape[2]),
        "fv": record.fill_value,
        "co": ENCODINGS[encoding],
        "ca": CHECKSUM_ALGORITHM,
        "cs": xxh3_64(payload),
        "pl": payload.nbytes,
        "ct": float(record.created) if record.created is not None else time.time(),
        "pr": record.producer if record.producer is not None else _producer(),
        "lm": pack_layer_map(record.layer_map),
        "tc": record.token_convention,
    }
    header.update(record.provenance.to_header())
    if record.metadata:
        header["md"] = record.metadata
    try:
        packed = msgpack.packb(header, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise RecordError(
            f"record {record.rollout_id!r}: metadata/producer cannot be packed as msgpack "
            f"(use str, int, float, bool, None, bytes, lists and str-keyed dicts): {exc}"
        ) from exc
    if len(packed) > MAX_HEADER_BYTES:
        raise RecordError(
            f"record {record.rollout_id!r}: header is {len(packed)} bytes, more than "
            f"{MAX_HEADER_BYTES}; keep metadata small"
        )
    return frame_header(packed), payload


def encode_record(record: RoutingRecord, *, encoding: str = "plain") -> bytes:
    """Encode ``record`` into one contiguous ``bytes`` object (one copy of the payload).

    ``bytes.join`` sizes the result once and copies header and payload into it, which is
    cheaper than filling a zero-initialised bytearray (no zeroing pass).  ``encoding`` as
    in :func:`encode_record_parts`.
    """
    head, payload = encode_record_parts(record, encoding=encoding)
    return b"".join((head, payload))


def read_header(buffer: bytes | bytearray | memoryview, *, require_payload: bool = True) -> RecordHeader:
    """Validate and return an rr-v1 header (no checksum pass).

    With ``require_payload=False`` the buffer may stop after the header (e.g. the first
    4 KiB of a file), for listing tools.  :meth:`RecordHeader.as_dict` gives it as a dict.
    """
    header, _ = parse_header(buffer, require_payload)
    return header


def decode_record(
    buffer: bytes | bytearray | memoryview, *, verify: bool = True, check_range: bool = False
) -> RoutingRecord:
    """Decode an rr-v1 record; ``ids`` is a read-only zero-copy view on ``buffer``.

    ``verify`` checks the payload checksum (one xxh3 pass); ``check_range`` also scans the
    ids for values ≥ num_experts other than the fill value.  Every malformation raises
    RecordError naming the problem.  Keep ``buffer`` alive and unmodified while the ids
    are in use (they share its memory).  A ``set``-encoded record is decoded into a new
    read-only array instead, each token-layer's ids ascending.
    """
    header, view = parse_header(buffer, require_payload=True)
    offset, length = header.payload_offset, header.payload_length
    if verify:
        actual = xxh3_64(view[offset : offset + length])
        if actual != header.checksum:
            raise RecordError(
                f"checksum mismatch in record {header.rollout_id!r}: header says "
                f"{header.checksum:#018x}, payload hashes to {actual:#018x} (corrupt payload)"
            )
    dtype, shape = header.ids_dtype, header.shape
    if header.codec == CODEC:
        ids = np.frombuffer(view, dtype=dtype, count=math.prod(shape), offset=offset).reshape(shape)
    else:
        try:
            ids = decode_sets(view[offset : offset + length], shape, header.num_experts,
                              header.fill_value, dtype)
        except RecordError as exc:
            raise RecordError(f"record {header.rollout_id!r}: {exc}") from exc
    ids.flags.writeable = False
    record = RoutingRecord(
        rollout_id=header.rollout_id,
        ids=ids,
        num_experts=header.num_experts,
        fill_value=header.fill_value,
        metadata=header.metadata,
        created=header.created,
        producer=header.producer,
        layers=header.layer_map,
        token_convention=header.token_convention,
        provenance=header.provenance,
    )
    if check_range:
        check_expert_range(record)
    return record


# ------------------------------------------------------------------ the header's size, before encoding

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
