"""Routing record format ``rr-v1``: encode, decode and read the header of one record.

One finished request becomes one self-describing record: a small msgpack header that says
what the payload is (rollout id, dtype, shape, fill value, checksum, ...) followed by the
raw ``[layers, tokens, top_k]`` array.  The payload never goes through msgpack (that would
cost an extra copy) and nothing is pickled.  Decoding is zero-copy: the returned array is
a read-only view on the caller's buffer.  The byte layout and the header's fields are in
:mod:`fd_routing_replay.codec.header`.
"""

from __future__ import annotations

import math
import os
import socket
import time
from functools import lru_cache
from typing import Any

import msgpack
import numpy as np

from fd_routing_replay._version import __version__
from fd_routing_replay.codec.checksum import xxh3_64
from fd_routing_replay.codec.framing import MAX_HEADER_BYTES, frame_header
from fd_routing_replay.codec.header import (
    CHECKSUM_ALGORITHM,
    CODEC,
    ENCODINGS,
    LAYOUT,
    RecordHeader,
    pack_layer_map,
    parse_header,
)
from fd_routing_replay.codec.record import RoutingRecord, check_expert_range, dtype_name
from fd_routing_replay.codec.setcodec import decode_sets, encode_sets
from fd_routing_replay.errors import RecordError

__all__ = ["decode_record", "encode_record", "encode_record_parts", "read_header"]


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
