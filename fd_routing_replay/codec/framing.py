"""The byte frame around an rr-v1 header: prefix, header checksum, padding, payload offset.

Version 2 (written since issue #21) protects the header itself: an 8-byte little-endian
xxh3_64 of bytes ``[0, 10 + H)`` (magic, version, header length and the msgpack header,
payload checksum ``cs`` included) follows the header, and every padding byte must be zero.
With ``cs`` over the payload, every byte of a record is then covered, so any single-bit
flip is refused.  Version 1 (no header checksum) still reads, reported as unverified.
The field-by-field validation of the msgpack map is :mod:`fd_routing_replay.codec.header`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from fd_routing_replay.codec.checksum import xxh3_64
from fd_routing_replay.errors import RecordError

__all__ = [
    "FORMAT_VERSION", "FORMAT_VERSIONS", "HEADER_CHECKSUM", "HEADER_CHECKSUM_BYTES", "MAGIC",
    "MAX_HEADER_BYTES", "PAYLOAD_ALIGNMENT", "PREFIX", "PREFIX_BYTES", "UNVERIFIED_VERSION",
    "Frame", "align", "byte_view", "frame_header", "header_checksum", "header_region_length",
    "read_frame",
]

MAGIC = b"\x89R3R"
"""First four bytes of every rr-v1 record: a non-ASCII, non-UTF-8 lead byte, then "R3R"."""
FORMAT_VERSION = 2
"""The version new records are written with (header checksummed)."""
UNVERIFIED_VERSION = 1
"""The first version: no header checksum; still decoded, with ``header_verified`` False."""
FORMAT_VERSIONS = (UNVERIFIED_VERSION, FORMAT_VERSION)
"""Every version this reader decodes.  1 (``01 00``) and 2 (``02 00``) differ in two bits,
so no single bit flip turns a version-2 record into a version-1 one."""
PAYLOAD_ALIGNMENT = 64
"""The payload starts at a multiple of this offset (cache line, SIMD and DMA friendly)."""
MAX_HEADER_BYTES = 64 * 1024
"""Largest msgpack header accepted on encode and decode (bounds work on corrupt input)."""
PREFIX = struct.Struct("<4sHI")
"""magic, format version, header length H."""
PREFIX_BYTES = PREFIX.size  # 10
HEADER_CHECKSUM = struct.Struct("<Q")
"""Version 2: xxh3_64 of bytes [0, 10 + H), right after the msgpack header."""
HEADER_CHECKSUM_BYTES = HEADER_CHECKSUM.size  # 8


def align(offset: int) -> int:
    """``offset`` rounded up to the payload alignment."""
    return -(-offset // PAYLOAD_ALIGNMENT) * PAYLOAD_ALIGNMENT


def byte_view(buffer: object, what: str = "record") -> memoryview:
    """``buffer`` as a flat contiguous byte view; RecordError (naming ``what``) otherwise."""
    try:
        view = memoryview(buffer)  # type: ignore[arg-type]
    except TypeError as exc:
        raise RecordError(f"{what}: expected a bytes-like buffer, got {type(buffer).__name__}") from exc
    if not view.c_contiguous:
        raise RecordError(f"{what}: buffer is not contiguous")
    if view.ndim != 1 or view.format != "B":
        try:
            view = view.cast("B")
        except TypeError as exc:
            raise RecordError(f"{what}: buffer of format {view.format!r} cannot be read as bytes") from exc
    return view


def header_checksum(prefix_and_header: bytes | memoryview) -> int:
    """The version-2 header checksum: xxh3_64 (seed 0) of magic, version, length, header."""
    return xxh3_64(prefix_and_header)


def frame_header(packed: bytes) -> bytes:
    """Prefix + msgpack header ``packed`` + header checksum + zero padding (version 2):
    everything before the payload."""
    start = PREFIX.pack(MAGIC, FORMAT_VERSION, len(packed)) + packed
    end = len(start) + HEADER_CHECKSUM_BYTES
    return b"".join((start, HEADER_CHECKSUM.pack(header_checksum(start)), bytes(align(end) - end)))


@dataclass(frozen=True)
class Frame:
    """Where the parts of a record are: the msgpack header is ``[PREFIX_BYTES, header_end)``,
    padding ``[region_end, payload_offset)``; ``verified`` says the header checksum matched
    (False for version 1, which has none)."""

    version: int
    header_length: int
    header_end: int
    region_end: int
    payload_offset: int
    verified: bool


def _prefix(view: memoryview) -> tuple[int, int]:
    """``(version, header length)`` of the prefix, checked."""
    size = view.nbytes
    if size < PREFIX_BYTES:
        raise RecordError(
            f"truncated record: {size} bytes, but an rr-v1 record starts with "
            f"{PREFIX_BYTES} bytes of magic, version and header length"
        )
    magic, version, header_len = PREFIX.unpack_from(view, 0)
    if magic != MAGIC:
        raise RecordError(
            f"bad magic {bytes(magic)!r} (expected {MAGIC!r}): not an rr-v1 record "
            "(a fastdeploy-raw value is read with decode_fastdeploy_raw)"
        )
    if version not in FORMAT_VERSIONS:
        known = " and ".join(str(v) for v in FORMAT_VERSIONS)
        raise RecordError(
            f"unsupported rr-v1 format version {version} (this reader knows versions "
            f"{known}); upgrade fd-routing-replay to read it"
        )
    if header_len > MAX_HEADER_BYTES:
        raise RecordError(f"header length {header_len} exceeds the limit of {MAX_HEADER_BYTES} bytes")
    return version, header_len


def header_region_length(prefix: bytes | memoryview) -> int:
    """How many bytes from a record's start :func:`read_frame` (and so ``read_header(...,
    require_payload=False)``) needs, from its first :data:`PREFIX_BYTES` bytes:
    ``10 + H`` (version 1) or ``10 + H + 8`` (version 2).  RecordError when ``prefix`` is
    short, not rr-v1, of an unknown version or announces an oversized header."""
    version, header_len = _prefix(byte_view(prefix))
    extra = HEADER_CHECKSUM_BYTES if version != UNVERIFIED_VERSION else 0
    return PREFIX_BYTES + header_len + extra


def read_frame(view: memoryview) -> Frame:
    """Check prefix, header checksum (version 2) and padding of the record in ``view``.

    ``view`` may stop anywhere after the header checksum (padding is checked as far as it
    goes).  RecordError names the problem: truncation, bad magic, unknown version,
    oversized header, header checksum mismatch, non-zero padding.
    """
    version, header_len = _prefix(view)
    header_end = PREFIX_BYTES + header_len
    verified = version != UNVERIFIED_VERSION
    region_end = header_end + (HEADER_CHECKSUM_BYTES if verified else 0)
    size = view.nbytes
    if region_end > size:
        what = "and its checksum " if verified else ""
        raise RecordError(
            f"truncated record: header length {header_len} {what}needs {region_end} bytes, "
            f"buffer has {size}"
        )
    if verified:
        (stored,) = HEADER_CHECKSUM.unpack_from(view, header_end)
        actual = header_checksum(view[:header_end])
        if actual != stored:
            raise RecordError(
                f"header checksum mismatch: stored {stored:#018x}, bytes 0..{header_end} hash "
                f"to {actual:#018x} (corrupt header)"
            )
    payload_offset = align(region_end)
    padding = view[region_end : min(payload_offset, size)]
    if padding.nbytes and any(padding):
        raise RecordError(
            f"non-zero padding between header and payload (bytes {region_end}..{payload_offset})"
        )
    return Frame(version, header_len, header_end, region_end, payload_offset, verified)
