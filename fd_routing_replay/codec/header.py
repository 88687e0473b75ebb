"""The rr-v1 header: its frame (prefix, header checksum, padding), its fields and their validation.

Byte layout (all integers little-endian; version 2)::

    offset  size  field
    0       4     magic  b"\\x89R3R"
    4       2     format version, uint16 (2; 1 for records without a header checksum)
    6       4     header length H, uint32 (bytes of msgpack that follow)
    10      H     msgpack map (the header, short keys; see HEADER_FIELDS)
    10+H    8     header checksum: xxh3_64 of bytes [0, 10+H), uint64 (version 2 only)
    10+H+8  pad   zero bytes up to the next multiple of 64 (payload alignment)
    P       N     payload: ids in C order, little-endian, N = L*T*K*itemsize (codec
                  "raw", the plain encoding), or the set encoding (codec "set",
                  fd_routing_replay.codec.setcodec): one bit-packed rank per token-layer

Version 2 (written since issue #21) protects the header itself: the header checksum covers
magic, version, header length and the msgpack map (payload checksum ``cs`` included), and
every padding byte must be zero.  With ``cs`` over the payload, every byte of a record is
then covered, so any single-bit flip is refused.  Version 1 (no header checksum) still
reads, reported as unverified.

:func:`read_frame` checks the frame; :func:`parse_header` checks the frame and every field
of the msgpack map, one small step per field, and returns a typed :class:`RecordHeader`;
unknown fields are ignored.  ``docs/record-format.md`` documents every field, the checksums
and the versioning rules.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from fd_routing_replay.codec.checksum import xxh3_64
from fd_routing_replay.codec.record import (
    DTYPES,
    MAX_DIM,
    MAX_LAYER_INDEX,
    TOKEN_CONVENTIONS,
    TOKEN_FORWARDED,
    Provenance,
    RecordFormat,
    is_int,
    layer_map_problem,
)
from fd_routing_replay.codec.setcodec import SetEncodingError, payload_nbytes
from fd_routing_replay.errors import RecordError

__all__ = [
    "CHECKSUM_ALGORITHM", "CODEC", "ENCODINGS", "ENCODING_BY_CODEC", "FORMAT_NAME",
    "FORMAT_VERSION", "FORMAT_VERSIONS", "HEADER_CHECKSUM", "HEADER_CHECKSUM_BYTES",
    "HEADER_FIELDS", "LAYOUT", "MAGIC", "MAX_HEADER_BYTES", "PAYLOAD_ALIGNMENT", "PREFIX",
    "PREFIX_BYTES", "UNVERIFIED_VERSION", "Frame", "RecordHeader", "align", "byte_view",
    "frame_header", "header_checksum", "header_region_length", "pack_layer_map",
    "parse_header", "read_frame", "unpack_layer_map",
]

# ------------------------------------------------------------------ the frame

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


# ------------------------------------------------------------------ the fields

FORMAT_NAME = RecordFormat.RR_V1.value
CHECKSUM_ALGORITHM = "xxh3_64"
LAYOUT = "LTK"
CODEC = "raw"
ENCODINGS: dict[str, str] = {"plain": CODEC, "set": "set"}
"""Payload encoding (``capture.encoding``) → the header's ``co`` value.  ``set`` keeps each
token-layer's top-k as a set (order not kept; decoded ascending): docs/record-format.md."""
ENCODING_BY_CODEC = {codec: name for name, codec in ENCODINGS.items()}
"""The header's ``co`` value → the payload encoding's name."""

HEADER_FIELDS: dict[str, str] = {
    "id": "rollout_id",
    "dt": "dtype",
    "sh": "shape",
    "lo": "layout",
    "ne": "num_experts",
    "k": "top_k",
    "fv": "fill_value",
    "co": "codec",
    "ca": "checksum_algorithm",
    "cs": "checksum",
    "pl": "payload_length",
    "ct": "created",
    "pr": "producer",
    "md": "metadata",
    "lm": "layer_map",
    "tc": "token_convention",
    "nd": "num_decoder_layers",
    "wv": "weights_version",
    "th": "tokens_hash",
    "sg": "segments",
}
"""Short msgpack key → meaning.  ``ct``, ``pr``, ``md``, ``lm``, ``tc`` and the provenance
fields ``nd``, ``wv``, ``th``, ``sg`` (:class:`~fd_routing_replay.codec.record.Provenance`) are optional
on decode (``lm`` defaults to ``range(L)``, ``tc`` to ``"forwarded"``, the others to None)."""


def pack_layer_map(layers: tuple[int, ...]) -> dict[str, int] | list[int]:
    """Compact form: ``{"s": start, "n": count}`` (+ ``"d": step`` when not 1) for an
    evenly spaced map, else the explicit list."""
    if not layers:
        return []
    step = layers[1] - layers[0] if len(layers) > 1 else 1
    if any(b - a != step for a, b in zip(layers, layers[1:], strict=False)):
        return list(layers)
    packed = {"s": layers[0], "n": len(layers)}
    if step != 1:
        packed["d"] = step
    return packed


@dataclass(frozen=True)
class RecordHeader:
    """A validated rr-v1 header (long field names), where its payload is and how long.

    ``encoding`` is the payload encoding's name (``plain`` or ``set``) of the header's
    ``codec`` value; ``layer_map`` is always filled in (``range(L)`` for records written
    before it existed); ``provenance`` holds the optional ``nd``, ``wv``, ``th``, ``sg``.
    ``header_verified`` is True when the header checksum (format version 2) matched, False
    for a version-1 record, whose header nothing protects.
    """

    version: int
    header_length: int
    payload_offset: int
    rollout_id: str
    dtype: str
    shape: tuple[int, int, int]
    layout: str
    num_experts: int
    top_k: int
    fill_value: int
    codec: str
    checksum_algorithm: str
    checksum: int
    payload_length: int
    created: float | None
    producer: dict[str, Any] | None
    metadata: dict[str, Any]
    layer_map: tuple[int, ...]
    token_convention: str
    provenance: Provenance
    header_verified: bool

    @property
    def format(self) -> RecordFormat:
        return RecordFormat.RR_V1

    @property
    def record_length(self) -> int:
        """Bytes of the whole record: payload offset + payload length."""
        return self.payload_offset + self.payload_length

    @property
    def encoding(self) -> str:
        return ENCODING_BY_CODEC[self.codec]

    @property
    def ids_dtype(self) -> np.dtype:
        """The numpy dtype of the decoded ids (little-endian)."""
        return DTYPES[self.dtype]

    def as_dict(self) -> dict[str, Any]:
        """The header as a plain dict (``shape`` and ``layer_map`` as lists; a provenance
        field only when recorded), plus ``format`` and ``encoding``: for listing tools."""
        out: dict[str, Any] = {
            "format": FORMAT_NAME, "version": self.version,
            "header_verified": self.header_verified,
            "header_length": self.header_length, "payload_offset": self.payload_offset,
            "rollout_id": self.rollout_id, "dtype": self.dtype, "shape": list(self.shape),
            "layout": self.layout, "num_experts": self.num_experts, "top_k": self.top_k,
            "fill_value": self.fill_value, "codec": self.codec, "encoding": self.encoding,
            "checksum_algorithm": self.checksum_algorithm, "checksum": self.checksum,
            "payload_length": self.payload_length, "created": self.created,
            "producer": self.producer, "metadata": self.metadata,
            "layer_map": list(self.layer_map), "token_convention": self.token_convention,
        }
        provenance = self.provenance
        for name, value in (("num_decoder_layers", provenance.num_decoder_layers),
                            ("weights_version", provenance.weights_version),
                            ("tokens_hash", provenance.tokens_hash),
                            ("segments", None if provenance.segments is None
                             else list(provenance.segments))):
            if value is not None:
                out[name] = value
        return out


# ------------------------------------------------------------------ field validation


def _bad(field_key: str, problem: str) -> RecordError:
    return RecordError(f"bad rr-v1 header field {field_key!r} ({HEADER_FIELDS[field_key]}): {problem}")


def _require(header: dict, key: str) -> Any:
    if key not in header:
        raise RecordError(f"rr-v1 header lacks required field {key!r} ({HEADER_FIELDS[key]})")
    return header[key]


def _int_field(header: dict, key: str, low: int, high: int) -> int:
    value = _require(header, key)
    if not is_int(value):
        raise _bad(key, f"expected an int, got {type(value).__name__} {value!r}")
    if not low <= value <= high:
        raise _bad(key, f"{value} is outside [{low}, {high}]")
    return value


def _unpack_map(view: memoryview, end: int) -> dict:
    try:
        header = msgpack.unpackb(view[PREFIX_BYTES:end], raw=False)
    except Exception as exc:  # any parse failure of untrusted bytes is a bad record
        raise RecordError(f"header is not valid msgpack: {type(exc).__name__}: {exc}") from exc
    if not isinstance(header, dict):
        raise RecordError(f"header must be a msgpack map, got {type(header).__name__}")
    return header


def _rollout_id(header: dict) -> str:
    rollout_id = _require(header, "id")
    if not isinstance(rollout_id, str) or not rollout_id:
        raise _bad("id", f"expected a non-empty str, got {rollout_id!r}")
    return rollout_id


def _dtype_name(header: dict) -> str:
    dtype_name = _require(header, "dt")
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        raise _bad("dt", f"{dtype_name!r} is not one of {sorted(DTYPES)}")
    return dtype_name


def _shape(header: dict) -> tuple[int, int, int]:
    shape = _require(header, "sh")
    if not isinstance(shape, list) or len(shape) != 3:
        raise _bad("sh", f"expected [layers, tokens, top_k], got {shape!r}")
    for dim in shape:
        if not is_int(dim) or not 0 <= dim <= MAX_DIM:
            raise _bad("sh", f"dimensions must be ints in [0, {MAX_DIM}], got {shape!r}")
    return shape[0], shape[1], shape[2]


def _layout(header: dict) -> str:
    layout = _require(header, "lo")
    if layout != LAYOUT:
        raise _bad("lo", f"unsupported layout {layout!r} (this reader knows {LAYOUT!r})")
    return layout


def _codec(header: dict) -> str:
    codec = _require(header, "co")
    if codec not in ENCODING_BY_CODEC:
        known = ", ".join(f"{c!r} ({name})" for name, c in ENCODINGS.items())
        raise _bad("co", f"unknown encoding {codec!r} (this reader knows {known}); a newer "
                         "fd-routing-replay may know it: upgrade to read it")
    return codec


def _checksum_algorithm(header: dict) -> str:
    algorithm = _require(header, "ca")
    if algorithm != CHECKSUM_ALGORITHM:
        raise _bad("ca", f"unsupported checksum algorithm {algorithm!r} (this reader knows {CHECKSUM_ALGORITHM!r})")
    return algorithm


def _payload_length(header: dict, shape: tuple[int, int, int], dtype_name: str, codec: str,
                    num_experts: int, top_k: int) -> int:
    """``pl``, checked against the size the shape, dtype and encoding make."""
    if codec == CODEC:
        expected_len = shape[0] * shape[1] * shape[2] * DTYPES[dtype_name].itemsize
    else:
        try:
            expected_len = payload_nbytes(shape[0] * shape[1], num_experts, top_k)
        except SetEncodingError as exc:
            raise _bad("co", str(exc)) from exc
    payload_len = _require(header, "pl")
    if not is_int(payload_len) or payload_len != expected_len:
        raise _bad("pl", f"{payload_len!r} disagrees with shape {list(shape)} of {dtype_name} in "
                         f"encoding {ENCODING_BY_CODEC[codec]!r} ({expected_len} bytes)")
    return payload_len


def _optional_fields(header: dict) -> tuple[float | None, dict | None, dict]:
    """``(created, producer, metadata)``: the optional fields a writer fills in."""
    created = header.get("ct")
    if created is not None and (not isinstance(created, (int, float)) or isinstance(created, bool)):
        raise _bad("ct", f"expected a unix time, got {created!r}")
    producer = header.get("pr")
    if producer is not None and not isinstance(producer, dict):
        raise _bad("pr", f"expected a map, got {producer!r}")
    metadata = header.get("md", {})
    if not isinstance(metadata, dict):
        raise _bad("md", f"expected a map, got {metadata!r}")
    return created, producer, metadata


def unpack_layer_map(value: Any, num_layers: int) -> tuple[int, ...]:
    """Validate an ``lm`` value; absent (records written before it existed) = range(L)."""
    if value is None:
        if num_layers > MAX_LAYER_INDEX + 1:
            raise _bad("sh", f"{num_layers} layers exceed the layer map's limit of "
                             f"{MAX_LAYER_INDEX + 1}")
        return tuple(range(num_layers))
    if isinstance(value, dict):
        return _unpack_layer_range(value, num_layers)
    if not isinstance(value, list):
        raise _bad("lm", f"expected a list of layer indices or a range map, got {value!r}")
    problem = layer_map_problem(value, num_layers)
    if problem:
        raise _bad("lm", problem)
    return tuple(value)


def _unpack_layer_range(value: dict, num_layers: int) -> tuple[int, ...]:
    """The range form ``{"s": start, "n": count, "d": step}`` of a layer map."""
    unknown = sorted(str(key) for key in value if key not in ("s", "n", "d"))
    if unknown:
        raise _bad("lm", f"unknown keys {unknown} in the range form (expected s, n, d)")
    start, count, step = value.get("s"), value.get("n"), value.get("d", 1)
    for name, number, low, high in (("s", start, 0, MAX_LAYER_INDEX),
                                    ("n", count, 0, MAX_LAYER_INDEX + 1),
                                    ("d", step, 1, MAX_LAYER_INDEX)):
        if not is_int(number) or not low <= number <= high:
            raise _bad("lm", f"range field {name!r} must be an int in [{low}, {high}], "
                             f"got {number!r}")
    if count != num_layers:
        raise _bad("lm", f"range of {count} layers disagrees with shape's {num_layers}")
    if count and start + (count - 1) * step > MAX_LAYER_INDEX:
        raise _bad("lm", f"range s={start}, n={count}, d={step} goes past layer "
                         f"{MAX_LAYER_INDEX}")
    return tuple(range(start, start + count * step, step))


def _token_convention(header: dict) -> str:
    token_convention = header.get("tc", TOKEN_FORWARDED)
    if token_convention not in TOKEN_CONVENTIONS:
        raise _bad("tc", f"unknown token convention {token_convention!r} (this reader knows "
                         f"{', '.join(repr(c) for c in TOKEN_CONVENTIONS)})")
    return token_convention


def _check_extent(view: memoryview, header: RecordHeader) -> None:
    """The buffer holds exactly the payload after the header (padding: ``read_frame``)."""
    size, total = view.nbytes, header.record_length
    if size < total:
        raise RecordError(
            f"truncated record {header.rollout_id!r}: {size} bytes, header promises {total} "
            f"({header.payload_length} payload bytes at offset {header.payload_offset})"
        )
    if size > total:
        raise RecordError(f"record {header.rollout_id!r}: {size - total} unexpected bytes after the payload")


def parse_header(buffer: object, require_payload: bool = True) -> tuple[RecordHeader, memoryview]:
    """Validate frame, header and extent of an rr-v1 record: ``(header, byte view)``.

    The frame first (prefix, header checksum of version 2, zero padding:
    :func:`read_frame`), then the fields in the order of
    :data:`HEADER_FIELDS`; the first problem raises RecordError naming it.  With
    ``require_payload=False`` the buffer may stop after the header checksum (e.g. the
    first 4 KiB of a file, or :func:`header_region_length`
    bytes).
    """
    view = byte_view(buffer)
    frame = read_frame(view)
    raw = _unpack_map(view, frame.header_end)
    rollout_id = _rollout_id(raw)
    dtype_name = _dtype_name(raw)
    max_value = int(np.iinfo(DTYPES[dtype_name]).max)
    shape = _shape(raw)
    layout = _layout(raw)
    num_experts = _int_field(raw, "ne", 1, max_value)
    top_k = _int_field(raw, "k", 0, MAX_DIM)
    if top_k != shape[2]:
        raise _bad("k", f"top_k {top_k} disagrees with shape {list(shape)}")
    fill_value = _int_field(raw, "fv", num_experts, max_value)
    codec = _codec(raw)
    algorithm = _checksum_algorithm(raw)
    checksum = _int_field(raw, "cs", 0, 2**64 - 1)
    payload_len = _payload_length(raw, shape, dtype_name, codec, num_experts, top_k)
    created, producer, metadata = _optional_fields(raw)
    layer_map = unpack_layer_map(raw.get("lm"), shape[0])
    token_convention = _token_convention(raw)
    provenance = Provenance.from_header(raw, shape[1], layer_map)  # validates nd, wv, th, sg
    header = RecordHeader(
        version=frame.version, header_length=frame.header_length,
        payload_offset=frame.payload_offset,
        rollout_id=rollout_id, dtype=dtype_name, shape=shape, layout=layout,
        num_experts=num_experts, top_k=top_k, fill_value=fill_value, codec=codec,
        checksum_algorithm=algorithm, checksum=checksum, payload_length=payload_len,
        created=created, producer=producer, metadata=metadata, layer_map=layer_map,
        token_convention=token_convention, provenance=provenance,
        header_verified=frame.verified,
    )
    if require_payload:
        _check_extent(view, header)
    return header, view
