"""The routing record and its byte formats.

A finished request's routing is one :class:`RoutingRecord`; it is stored as a
self-describing ``rr-v1`` record (msgpack header + raw payload, decoded zero-copy, never
pickled) or, for compatibility, as FastDeploy's header-less ``fastdeploy-raw`` bytes.
``docs/record-format.md`` documents every field, the checksum and the versioning rules.
"""

from __future__ import annotations

from fd_routing_replay.codec.fastdeploy_raw import decode_fastdeploy_raw, encode_fastdeploy_raw
from fd_routing_replay.codec.header import (
    CHECKSUM_ALGORITHM,
    ENCODINGS,
    FORMAT_NAME,
    FORMAT_VERSION,
    FORMAT_VERSIONS,
    HEADER_CHECKSUM_BYTES,
    HEADER_FIELDS,
    MAGIC,
    MAX_HEADER_BYTES,
    PAYLOAD_ALIGNMENT,
    PREFIX_BYTES,
    RecordHeader,
    header_region_length,
    pack_layer_map,
)
from fd_routing_replay.codec.record import (
    MAX_LAYER_INDEX,
    TOKEN_CONVENTIONS,
    TOKEN_FORWARDED,
    RecordFormat,
    RoutingRecord,
    check_expert_range,
    check_layer_map,
    routing_dtype,
)
from fd_routing_replay.codec.rr_v1 import (
    decode_record,
    encode_record,
    encode_record_parts,
    read_header,
)

__all__ = [
    "CHECKSUM_ALGORITHM", "ENCODINGS", "FORMAT_NAME", "FORMAT_VERSION", "FORMAT_VERSIONS",
    "HEADER_CHECKSUM_BYTES", "HEADER_FIELDS", "MAGIC", "MAX_HEADER_BYTES", "MAX_LAYER_INDEX",
    "PAYLOAD_ALIGNMENT", "PREFIX_BYTES", "RecordFormat", "RecordHeader", "TOKEN_CONVENTIONS",
    "TOKEN_FORWARDED", "RoutingRecord", "check_expert_range", "check_layer_map",
    "decode_fastdeploy_raw", "decode_record", "encode_fastdeploy_raw", "encode_record",
    "encode_record_parts", "header_region_length", "pack_layer_map", "read_header",
    "routing_dtype",
]
